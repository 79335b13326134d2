// Weight-only int8 linear for small batches on x86 CPUs: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] + bias[n].
//
// Decode at small batch is bound by the bytes of weight read per token: int8 weights halve them
// against bf16. Widening every weight to float32 costs three AVX-512 instructions per 16 weights,
// which made a float32 kernel compute bound, so the dot products run on AVX512-VNNI's int16 pairs
// (vpdpwssd: 32 multiply-adds per instruction) against activations held as 16-bit fixed point per
// row (see kActMax). Output columns are split across ATen's thread pool, the pool every other op of
// the engine uses (no second OpenMP runtime fighting for the cores).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PAGODA_VNNI 1
#endif

namespace {

// Activations enter the integer dot product as 16-bit fixed point per row: x ~ a * row_scale with
// |a| <= kActMax. That is finer than bf16's 8-bit mantissa for every value within 2^6 of the row's
// largest, and it is per row, so a request's result never depends on the rest of its batch.
// int8 x int16 products are summed in int32 over chunks of kChunk elements (|sum| < 2^31 by
// construction) and flushed to float32 between chunks.
constexpr int32_t kActMax = 16383;
constexpr int64_t kChunk = 256;  // 256 * 16383 * 127 < 2^31
constexpr int64_t kPrefetch = 1024;  // bytes ahead in each weight row

// acc[m * NB + j] = sum_k a[m, k] * q[j, k] for MB activation rows and NB weight rows.
template <int MB, int NB>
inline void tile(const int16_t* a, int64_t K, const int8_t* q, float* acc) {
  int64_t k = 0;
#ifdef PAGODA_VNNI
  const int64_t vector_end = K - K % 32;
  __m512 facc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) facc[m][j] = _mm512_setzero_ps();
  while (k < vector_end) {
    const int64_t chunk_end = std::min(vector_end, k + kChunk);
    __m512i iacc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) iacc[m][j] = _mm512_setzero_si512();
    for (; k < chunk_end; k += 32) {
      __m512i w[NB];
      for (int j = 0; j < NB; ++j) {
        // NB weight rows are NB separate streams: prefetch each well ahead of use
        _mm_prefetch(reinterpret_cast<const char*>(q + j * K + k + kPrefetch), _MM_HINT_T0);
        w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * K + k)));
      }
      for (int m = 0; m < MB; ++m) {
        const __m512i av = _mm512_loadu_si512(a + m * K + k);
        for (int j = 0; j < NB; ++j) iacc[m][j] = _mm512_dpwssd_epi32(iacc[m][j], av, w[j]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) facc[m][j] = _mm512_add_ps(facc[m][j], _mm512_cvtepi32_ps(iacc[m][j]));
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m * NB + j] = _mm512_reduce_add_ps(facc[m][j]);
#else
  for (int i = 0; i < MB * NB; ++i) acc[i] = 0.0f;
#endif
  for (; k < K; ++k)  // the tail, or everything without AVX-512 VNNI
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j)
        acc[m * NB + j] += static_cast<float>(static_cast<int32_t>(a[m * K + k]) * static_cast<int32_t>(q[j * K + k]));
}

// Output columns [col, col + width) for activation rows [m0, m0 + MB).
template <int MB, int NB, typename scalar_t>
inline void store_tile(const float* acc, const float* row_scale, int64_t m0, const float* scales, const float* bias,
                       scalar_t* y, int64_t N, int64_t col) {
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const float b = bias != nullptr ? bias[col + j] : 0.0f;
      const float value = acc[m * NB + j] * (scales[col + j] * row_scale[m0 + m]) + b;
      y[(m0 + m) * N + col + j] = static_cast<scalar_t>(value);
    }
}

// Columns [col, col + NB) for every activation row: the NB weight rows are read from memory once
// and stay in L1 while each pair of activation rows passes over them.
template <int NB, typename scalar_t>
void columns(const int16_t* a, const float* row_scale, int64_t M, int64_t K, const int8_t* q, const float* scales,
             const float* bias, scalar_t* y, int64_t N, int64_t col) {
  float acc[2 * NB];
  int64_t m0 = 0;
  for (; m0 + 2 <= M; m0 += 2) {
    tile<2, NB>(a + m0 * K, K, q + col * K, acc);
    store_tile<2, NB>(acc, row_scale, m0, scales, bias, y, N, col);
  }
  if (m0 < M) {
    tile<1, NB>(a + m0 * K, K, q + col * K, acc);
    store_tile<1, NB>(acc, row_scale, m0, scales, bias, y, N, col);
  }
}

// Per row: a = round(x / s) with s = max|x| / kActMax (s = 0 for an all-zero row).
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* a, float* row_scale) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[m * K + k]));
    const float inv = amax > 0.0f ? kActMax / amax : 0.0f;
    row_scale[m] = amax / kActMax;
    for (int64_t k = 0; k < K; ++k) a[m * K + k] = static_cast<int16_t>(std::nearbyint(x[m * K + k] * inv));
  }
}

template <typename scalar_t>
void int8_linear_kernel(const int16_t* a, const float* row_scale, int64_t M, int64_t K, const int8_t* q,
                        const float* scales, const float* bias, scalar_t* y, int64_t N) {
  // Grain: enough columns per task that a task streams a few hundred KB of weights.
  const int64_t grain = std::max<int64_t>(16, (1 << 18) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    for (; n + 4 <= n_end; n += 4) columns<4>(a, row_scale, M, K, q, scales, bias, y, N, n);
    for (; n < n_end; ++n) columns<1>(a, row_scale, M, K, q, scales, bias, y, N, n);
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
  auto a = at::empty({M, K}, x.options().dtype(at::kShort));
  auto row_scale = at::empty({M}, x.options().dtype(at::kFloat));
  quantize_rows(x2.data_ptr<float>(), M, K, a.data_ptr<int16_t>(), row_scale.data_ptr<float>());
  auto q = qweight.contiguous();
  auto s = scales.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    int8_linear_kernel<scalar_t>(a.data_ptr<int16_t>(), row_scale.data_ptr<float>(), M, K, q.data_ptr<int8_t>(),
                                 s.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                                 y.data_ptr<scalar_t>(), N);
  });
  return y.view(out_sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("int8_linear", &int8_linear); }
