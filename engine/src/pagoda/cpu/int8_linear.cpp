// Weight-only int8 linear for small batches on x86 CPUs: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] + bias[n].
//
// Decode at small batch is bound by the bytes of weight read per token. The int8 weights are read
// once per step and widened to fp32 in registers (AVX-512), so a step reads half the bytes of bf16;
// the activations stay in their own dtype (weight-only: no activation quantization, results do not
// depend on what else is in the batch). Rows of the output are split across ATen's thread pool,
// the same pool every other op of the engine uses (no second OpenMP runtime fighting for the cores).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGODA_AVX512 1
#endif

namespace {

// Output tile: MB activation rows x NB weight rows, MB * NB independent accumulators in registers
// (a single accumulator chain would be bound by FMA latency, not by memory).
template <int MB, int NB>
inline void tile(const float* x, int64_t K, const int8_t* q, float* acc) {
  int64_t k = 0;
#ifdef PAGODA_AVX512
  __m512 vacc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) vacc[m][j] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 w[NB];
    for (int j = 0; j < NB; ++j) {
      __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * K + k));
      w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8));
    }
    for (int m = 0; m < MB; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int j = 0; j < NB; ++j) vacc[m][j] = _mm512_fmadd_ps(w[j], xv, vacc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m * NB + j] = _mm512_reduce_add_ps(vacc[m][j]);
#else
  for (int i = 0; i < MB * NB; ++i) acc[i] = 0.0f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[m * NB + j] += x[m * K + k] * static_cast<float>(q[j * K + k]);
}

template <int MB, int NB, typename scalar_t>
void rows_block(const float* x, int64_t m0, int64_t K, const int8_t* q, const float* scales, const float* bias,
                scalar_t* y, int64_t N, int64_t n_begin, int64_t n_end) {
  float acc[MB * NB];
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) {
    tile<MB, NB>(x + m0 * K, K, q + n * K, acc);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) {
        const float b = bias != nullptr ? bias[n + j] : 0.0f;
        y[(m0 + m) * N + n + j] = static_cast<scalar_t>(acc[m * NB + j] * scales[n + j] + b);
      }
  }
  for (; n < n_end; ++n) {  // fewer than NB columns left
    tile<MB, 1>(x + m0 * K, K, q + n * K, acc);
    for (int m = 0; m < MB; ++m) {
      const float b = bias != nullptr ? bias[n] : 0.0f;
      y[(m0 + m) * N + n] = static_cast<scalar_t>(acc[m] * scales[n] + b);
    }
  }
}

template <typename scalar_t>
void int8_linear_kernel(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scales,
                        const float* bias, scalar_t* y, int64_t N) {
  // Grain: enough columns per task that a task streams a few hundred KB of weights.
  const int64_t grain = std::max<int64_t>(16, (1 << 18) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n_begin, int64_t n_end) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) rows_block<4, 4>(x, m0, K, q, scales, bias, y, N, n_begin, n_end);
    for (; m0 + 2 <= M; m0 += 2) rows_block<2, 4>(x, m0, K, q, scales, bias, y, N, n_begin, n_end);
    for (; m0 < M; ++m0) rows_block<1, 4>(x, m0, K, q, scales, bias, y, N, n_begin, n_end);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "int8_linear runs on the CPU");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "qweight must be [N, K] int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == qweight.size(0), "scales must be [N] float32");
  const int64_t K = qweight.size(1), N = qweight.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();  // [M, K] fp32 (a few KB at decode)
  const int64_t M = x2.size(0);
  auto q = qweight.contiguous();
  auto s = scales.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    int8_linear_kernel<scalar_t>(x2.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), s.data_ptr<float>(),
                                 b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<scalar_t>(), N);
  });
  return y.view(out_sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("int8_linear", &int8_linear); }
