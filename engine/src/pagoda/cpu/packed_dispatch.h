// The op boundary shared by the packed linear kernels (packed_linear*.cpp): argument checks, the activations as
// tile rows, the output tensor with its dtype dispatch, and the raise of an op this build has no kernel for. The
// kernels themselves and the tile machinery are in packed_tiles.h.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "packed_tiles.h"

namespace pagoda_packed {

// The optional bias as float32 [N] (undefined without one)
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->numel() == N, "bias must be [", N, "], got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// A float32 tensor's data, nullptr for an undefined one (float_bias without a bias): what the epilogues take.
inline const float* float_data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// What the epilogue of a weight-only quantized linear (int8, fp8) applies beside the sums, as float32: one scale per
// output row of the weight (per output column of y) and the optional bias. Holds the tensors for the pointers, which
// the ops copy to locals for their epilogue lambdas: capturing the struct instead compiled the tile loops with
// other registers.
struct ScaledEpilogue {
  ScaledEpilogue(const at::Tensor& scales, const std::optional<at::Tensor>& bias, int64_t N)
      : scales_(scales.contiguous()),
        bias_(float_bias(bias, N)),
        col_scale(scales_.data_ptr<float>()),
        bias_data(float_data_or_null(bias_)) {}

  at::Tensor scales_, bias_;
  const float* col_scale;  // [N]
  const float* bias_data;  // [N] or nullptr
};

inline void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed linear runs on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2, "weight is not in packed layout");
  TORCH_CHECK(packed.is_contiguous(), "packed weight must be contiguous");
  TORCH_CHECK(N > 0 && N <= packed.size(0) * kTile, "N=", N, " does not fit the packed weight");
  TORCH_CHECK((x.size(-1) + 1) / 2 == packed.size(1), "x has ", x.size(-1), " features, the weight ",
              packed.size(1) * 2, " (padded)");
}

// A gated weight's rows: 2n in tiles of 32 gate + 32 up rows (any packed layout with packed.size(0) tiles).
inline void check_gated_rows(const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(n % (kTile / 2) == 0 && packed.size(0) * kTile == 2 * n, "a gated weight holds 2n rows, n % 32 == 0");
}

// The gated kernels' shape rules on the [tiles][pairs][64][2] layout, bf16 activations.
inline void check_gated(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_packed(x, packed, 2 * n);
  check_gated_rows(packed, n);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "the gated kernels take bf16 activations");
}

// The rows of x [..., K]: M of the [M, K] matrix the kernels see.
inline int64_t row_count(const at::Tensor& x) { return x.numel() / std::max<int64_t>(x.size(-1), 1); }

// x as contiguous [M, 2 * pairs] rows, zero padded to the packed weight's k (an odd K)
inline at::Tensor padded_rows(const at::Tensor& x, int64_t pairs) {
  const int64_t K = x.size(-1);
  auto rows = x.reshape({-1, K});
  if (pairs * 2 != K) rows = at::constant_pad_nd(rows, {0, pairs * 2 - K});
  return rows.contiguous();
}

inline at::Tensor view_output(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// [..., N] from fill(yp), which writes the [M, N] output rows through yp: a scalar_t* (x's dtype), or a float* with
// float_out, float32 holding the scalar_t rounding of every value (y.float() without a second pass: logits). One
// generic fill serves both, so each kernel's epilogue (store_tile<scalar_t>) is written once.
template <typename scalar_t, typename Fill>
at::Tensor linear_output(const at::Tensor& x, int64_t N, int64_t M, bool float_out, const Fill& fill) {
  auto y = at::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());
  if (float_out) {
    fill(y.data_ptr<float>());
  } else {
    fill(y.data_ptr<scalar_t>());
  }
  return view_output(y, x, N);
}

// [..., n] bf16 from fill(yp), which writes a gated kernel's [M, n] rows of silu(gate) * up through yp.
template <typename Fill>
at::Tensor gated_output(const at::Tensor& x, int64_t n, int64_t M, const Fill& fill) {
  auto y = at::empty({M, n}, x.options());
  fill(y.data_ptr<at::BFloat16>());
  return view_output(y, x, n);
}

// The body of an op whose instructions this build (compiled with -march=native for this machine) lacks. The op
// stays registered so that every build has the same schema; callers ask the *_support() ops before calling.
[[noreturn]] inline void missing_isa(const char* op, const char* isa) {
  TORCH_CHECK(false, op, " needs ", isa, ", which this build lacks");
}

}  // namespace pagoda_packed
