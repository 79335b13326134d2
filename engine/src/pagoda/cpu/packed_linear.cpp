// Linear layers on x86 CPUs with weights repacked once at load: y[m, n] = sum_k x[m, k] * w[n, k] + bias[n].
//
// Decode at small batch is bound by weight bytes read per token. The layout makes that read one
// sequential stream per thread with no horizontal reductions:
//
//   packed: [ceil(N / 64)][ceil(K / 2)][64][2]   (a tile of 64 output rows, k in pairs)
//
// One k-pair of a tile is 64 rows x 2 values: four vectors whose lane i holds row i's pair. A dot
// product instruction against the activation's pair broadcast to every lane adds x[2p] * w[2p] +
// x[2p+1] * w[2p+1] into lane i, so sixteen output rows accumulate per register and the sums are
// finished when the k loop ends.
//
// - bf16 weights run on AVX512-BF16 (vdpbf16ps: float32 sums of bf16 products). On this layout it
//   matches oneDNN's packed GEMM in compute-bound prefill and reads ~1.3x faster at batch 1.
// - A gated [gate | up] weight (bf16_silu_mul_linear) is packed with each tile holding 32 gate rows and the
//   matching 32 up rows; its epilogue writes silu(gate) * up.
// - int8 weights (weight-only quantization, per-row scale): packed_linear_int8.cpp, gated too.
//
// Tiles are split across ATen's thread pool, the pool every other op of the engine uses (packed_tiles.h); the ops'
// checks and output dispatch are shared by all packed linears (packed_dispatch.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "packed_dispatch.h"

namespace {

using namespace pagoda_packed;

// [N, K] -> [ceil(N/64), ceil(K/2), 64, 2], zero padded
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t tiles = (N + kTile - 1) / kTile, pairs = (K + 1) / 2;
  auto padded = at::zeros({tiles * kTile, pairs * 2}, weight.options());
  padded.slice(0, 0, N).slice(1, 0, K).copy_(weight);
  return padded.view({tiles, kTile, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

// The [N, K] weight back from its packed form (a copy).
at::Tensor unpack_weight(const at::Tensor& packed, int64_t N, int64_t K) {
  const int64_t tiles = packed.size(0), pairs = packed.size(1);
  return packed.permute({0, 2, 1, 3}).reshape({tiles * kTile, pairs * 2}).slice(0, 0, N).slice(1, 0, K).contiguous();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                       bool float_out) {
#ifdef PAGODA_BF16_DOT
  check_packed(x, packed, N);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_linear takes bf16");
  const int64_t pairs = packed.size(1);
  const auto x2 = padded_rows(x, pairs);
  const int64_t M = x2.size(0);
  const auto b = float_bias(bias, N);
  const auto* xp = reinterpret_cast<const uint32_t*>(x2.data_ptr());
  const auto* wp = static_cast<const char*>(packed.data_ptr());
  const float* bp = float_data_or_null(b);
  const int64_t tile_bytes = pairs * kTile * 2 * 2;
  return linear_output<at::BFloat16>(x, N, M, float_out, [&](auto* yp) {
    run_tiles<Bf16Pass>(xp, M, pairs, wp, tile_bytes, packed.size(0), [&](const float* acc, int64_t t) {
      store_tile<at::BFloat16>(acc, M, t * kTile, nullptr, nullptr, bp, yp, N);
    });
  });
#else
  missing_isa("bf16_linear", "AVX512-BF16");
#endif
}

// silu(x W_gate^T + b_gate) * (x W_up^T + b_up) -> [..., n] for a packed gated weight (2n rows in the order
// store_gated_tile reads, packed_tiles.h; the bias, if any, in that order too), rounded like bf16_linear then
// silu_and_mul.
at::Tensor bf16_silu_mul_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const std::optional<at::Tensor>& bias) {
#ifdef PAGODA_BF16_DOT
  check_gated(x, packed, n);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "bf16_silu_mul_linear takes a bf16 packed weight");
  const int64_t pairs = packed.size(1);
  const auto x2 = padded_rows(x, pairs);
  const int64_t M = x2.size(0);
  const auto b = float_bias(bias, 2 * n);
  const float* bp = float_data_or_null(b);
  return gated_output(x, n, M, [&](at::BFloat16* yp) {
    run_tiles<Bf16Pass>(reinterpret_cast<const uint32_t*>(x2.data_ptr()), M, pairs,
                        static_cast<const char*>(packed.data_ptr()), pairs * kTile * 2 * 2, packed.size(0),
                        [&](const float* acc, int64_t t) { store_gated_tile(acc, M, t, nullptr, nullptr, bp, yp, n); });
  });
#else
  missing_isa("bf16_silu_mul_linear", "AVX512-BF16");
#endif
}

// Which packed kernels this build (compiled for this machine) can run: bit 0 bf16, bit 1 int8.
int64_t packed_linear_support() {
  int64_t bits = 0;
#ifdef PAGODA_BF16_DOT
  bits |= 1;
#endif
#ifdef PAGODA_INT16_DOT
  bits |= 2;
#endif
  return bits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("unpack_linear_weight(Tensor packed, int n, int k) -> Tensor");
  // float_out: float32 output holding the x-dtype rounding of every value, i.e. y.float() in one pass (logits)
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("bf16_silu_mul_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("packed_linear_support() -> int", &packed_linear_support);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_weight);
  m.impl("unpack_linear_weight", &unpack_weight);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_silu_mul_linear", &bf16_silu_mul_linear);
}
