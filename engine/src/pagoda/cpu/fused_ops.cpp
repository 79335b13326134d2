// Fused elementwise ops for the CPU decode path: one dispatch instead of five to ten small ATen ops.
//
// At decode the model's non-GEMM ops work on a few KB each, so their cost is per-op overhead, not
// arithmetic: ~40 such ops per layer add milliseconds per step. Each op here reproduces the
// rounding steps of the unfused PyTorch expression it replaces (computing in float32 and rounding to
// the activation dtype wherever PyTorch would), so results match transformers up to the order of a
// float32 sum inside RMSNorm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>
#include <type_traits>

#include "vec_math.h"

namespace {

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

// Rows of `width` contiguous elements: row r starts at (r / heads) * token_stride + (r % heads) * width.
// Per-head views of a fused qkv output ([tokens, heads, head_dim] with a token stride of the whole qkv
// row) are read in place instead of being copied first.
struct RowLayout {
  at::Tensor tensor;
  int64_t heads, token_stride;

  int64_t offset(int64_t r, int64_t width) const { return (r / heads) * token_stride + (r % heads) * width; }
};

RowLayout row_layout(const at::Tensor& x) {
  const int64_t width = x.size(-1);
  if (x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == width && x.size(1) > 0) return {x, x.size(1), x.stride(0)};
  return {x.contiguous(), 1, width};
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGODA_FUSED_BF16 1
using pagoda_simd::load16;
using pagoda_simd::round_bf16;
using pagoda_simd::silu_mul_bf16;
using pagoda_simd::store_bf16;

// One bf16 row of rms_rows, 16 lanes at a time with the same rounding steps (prefill runs thousands of rows).
inline void rms_row_bf16(const at::BFloat16* xr, const at::BFloat16* res, const at::BFloat16* weight, at::BFloat16* out,
                         at::BFloat16* sum_out, int64_t hidden, float eps, float* s) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    __m512 v = load16(xr + i);
    if (res != nullptr) {
      v = round_bf16(_mm512_add_ps(v, load16(res + i)));
      store_bf16(sum_out + i, v);
    }
    _mm512_storeu_ps(s + i, v);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(hidden) + eps));
  for (int64_t i = 0; i < hidden; i += 16)
    store_bf16(out + i, _mm512_mul_ps(load16(weight + i), round_bf16(_mm512_mul_ps(_mm512_loadu_ps(s + i), inv))));
}

#endif

// out = weight * to_dtype(s * rsqrt(mean(s^2) + eps)), s = x (+ residual, rounded to the dtype)
template <typename T>
void rms_rows(const T* x, const RowLayout& layout, const T* residual, const T* weight, T* out, T* sum_out,
              int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> s(hidden);
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + layout.offset(r, hidden);
#ifdef PAGODA_FUSED_BF16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (hidden % 16 == 0) {
          rms_row_bf16(xr, residual != nullptr ? residual + r * hidden : nullptr, weight, out + r * hidden,
                       sum_out != nullptr ? sum_out + r * hidden : nullptr, hidden, eps, s.data());
          continue;
        }
      }
#endif
      float acc = 0.0f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = f(xr[i]);
        if (residual != nullptr) {
          const T summed = static_cast<T>(v + f(residual[r * hidden + i]));
          sum_out[r * hidden + i] = summed;
          v = f(summed);
        }
        s[i] = v;
        acc += v * v;
      }
      const float inv = 1.0f / std::sqrt(acc / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) {
        out[r * hidden + i] = static_cast<T>(f(weight[i]) * f(static_cast<T>(s[i] * inv)));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden && weight.scalar_type() == x.scalar_type(), "weight must be [hidden] in x's dtype");
  const RowLayout layout = row_layout(x);
  auto w = weight.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(layout.tensor.data_ptr<scalar_t>(), layout, nullptr, w.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), nullptr, x.numel() / hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  TORCH_CHECK(weight.numel() == hidden && weight.scalar_type() == x.scalar_type(), "weight must be [hidden] in x's dtype");
  auto xc = x.contiguous();
  auto rc = residual.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty_like(xc);
  auto summed = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), RowLayout{xc, 1, hidden}, rc.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), summed.data_ptr<scalar_t>(), xc.numel() / hidden, hidden,
                       static_cast<float>(eps));
  });
  return {out, summed};
}

#ifdef PAGODA_FUSED_BF16
// One bf16 row of rotary, 16 lanes at a time with the scalar loop's rounding steps (bit-identical to it):
// the scalar loop converted every element to and from bf16 one by one, at prefill ~15 ms per 512 tokens.
inline void rotary_row_bf16(const at::BFloat16* x, const at::BFloat16* c, const at::BFloat16* s, at::BFloat16* out,
                            int64_t half) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 lo = load16(x + i), hi = load16(x + half + i);
    // out[i] = (x[i] c[i]) + (-x[i + half]) s[i];  out[i + half] = (x[i + half] c[i + half]) + x[i] s[i + half]
    const __m512 a_lo = round_bf16(_mm512_mul_ps(lo, load16(c + i)));
    const __m512 b_lo = round_bf16(_mm512_mul_ps(_mm512_xor_ps(hi, sign), load16(s + i)));
    const __m512 a_hi = round_bf16(_mm512_mul_ps(hi, load16(c + half + i)));
    const __m512 b_hi = round_bf16(_mm512_mul_ps(lo, load16(s + half + i)));
    store_bf16(out + i, _mm512_add_ps(a_lo, b_lo));
    store_bf16(out + half + i, _mm512_add_ps(a_hi, b_hi));
  }
}
#endif

// Rotate-half RoPE, rounded like x * cos + rotate_half(x) * sin evaluated op by op in the dtype.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3, "x must be [num_tokens, num_heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "cos/sin must be [num_tokens, head_dim]");
  const RowLayout layout = row_layout(x);
  auto cc = cos.to(x.scalar_type()).contiguous();
  auto sc = sin.to(x.scalar_type()).contiguous();
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    using T = scalar_t;
    const T* px = layout.tensor.data_ptr<T>();
    const T* pc = cc.data_ptr<T>();
    const T* ps = sc.data_ptr<T>();
    T* po = out.data_ptr<T>();
    at::parallel_for(0, tokens * heads, std::max<int64_t>(1, 16384 / dim), [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        const int64_t t = row / heads;
        const T* xr = px + layout.offset(row, dim);
        const T* c = pc + t * dim;
        const T* s = ps + t * dim;
#ifdef PAGODA_FUSED_BF16
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (half % 16 == 0) {
            using B = at::BFloat16;  // T is B here; the casts only let the other dtypes' copies compile
            rotary_row_bf16(reinterpret_cast<const B*>(xr), reinterpret_cast<const B*>(c), reinterpret_cast<const B*>(s),
                            reinterpret_cast<B*>(po + row * dim), half);
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < dim; ++i) {
          const float rotated = i < half ? -f(xr[i + half]) : f(xr[i - half]);
          const T a = static_cast<T>(f(xr[i]) * f(c[i]));
          const T bb = static_cast<T>(rotated * f(s[i]));
          po[row * dim + i] = static_cast<T>(f(a) + f(bb));
        }
      }
    });
  });
  return out.view(x.sizes());
}

// out[i] = bf16(silu(gate[i])) * up[i], rounded to T like F.silu(gate) * up.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t inter) {
  int64_t i = 0;
#ifdef PAGODA_FUSED_BF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    for (; i + 16 <= inter; i += 16) store_bf16(out + i, silu_mul_bf16(load16(gate + i), load16(up + i)));
  }
#endif
  for (; i < inter; ++i) {
    const float g = f(gate[i]);
    const T act = static_cast<T>(g / (1.0f + std::exp(-g)));
    out[i] = static_cast<T>(f(act) * f(up[i]));
  }
}

// silu(gate) * up for x = [gate | up] along the last dimension.
at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t width = x.size(-1), inter = width / 2;
  TORCH_CHECK(width % 2 == 0, "the last dimension must hold [gate | up]");
  auto xc = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, x.options());
  const int64_t rows = xc.numel() / width;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    const T* px = xc.data_ptr<T>();
    T* po = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_row<T>(px + r * width, px + r * width + inter, po + r * inter, inter);
    });
  });
  return out;
}

// Index of the row's largest value, the first one on ties; a NaN counts as the largest (torch.argmax).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = x[0];
#ifdef __AVX512F__
  if (n >= 32) {  // per-lane running max and its first index, then the first index of the overall max
    __m512 top = _mm512_loadu_ps(x);
    __m512i top_index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i index = top_index;
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, greater, v);
      top_index = _mm512_mask_mov_epi32(top_index, greater, index);
    }
    if (nan != 0) {
      for (int64_t j = 0; j < i; ++j)
        if (std::isnan(x[j])) return j;
    }
    best_value = _mm512_reduce_max_ps(top);
    const __mmask16 at_max = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(at_max, top_index);
  }
#endif
  for (; i < n; ++i) {  // the tail's indices are larger: only a strictly greater value (or a NaN) wins
    if (std::isnan(x[i])) return i;
    if (x[i] > best_value) {
      best_value = x[i];
      best = i;
    }
  }
  return best;
}

// Greedy sampling: argmax over the last dim of [rows, n] float32 logits, as torch.argmax(dim=-1) returns it.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows takes [rows, n] float32 with n > 0");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "rows are limited to 2^31 values");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* px = x.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) po[r] = argmax_row(px + r * n, n);
  });
  return out;
}

// Logits with the tokens a grammar forbids at -inf, in one pass that also does the copy the sampler needs: rows
// listed in `rows` keep token 32 * w + j only if bit j of bitmask[row][w] is set (xgrammar's layout), the other
// rows are copied unchanged. Most words of a constrained row are 0 (nothing allowed) and become one run of -inf
// stores. xgrammar's own CPU kernel tests every bit of every row: 18 ms for [32, 151936] on two cores, this 2 ms.
at::Tensor grammar_masked_logits(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be [rows, vocab] float32");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.size(0) == logits.size(0),
              "bitmask must be [rows, words] int32 with one row per logits row");
  TORCH_CHECK(bitmask.size(1) * 32 >= logits.size(1), "bitmask has fewer bits than the vocabulary");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be a 1-D int64 tensor");
  auto x = logits.contiguous();
  auto bm = bitmask.contiguous();
  auto out = at::empty_like(x);
  const int64_t num_rows = x.size(0), vocab = x.size(1), words = bm.size(1);
  std::vector<char> masked(num_rows, 0);
  auto rows_c = rows.contiguous();
  const int64_t* pr = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows_c.numel(); ++i) {
    TORCH_CHECK(pr[i] >= 0 && pr[i] < num_rows, "row index out of range");
    masked[pr[i]] = 1;
  }
  const float* px = x.data_ptr<float>();
  const uint32_t* pb = reinterpret_cast<const uint32_t*>(bm.data_ptr<int32_t>());
  float* po = out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = px + r * vocab;
      float* dst = po + r * vocab;
      if (!masked[r]) {
        std::memcpy(dst, src, vocab * sizeof(float));
        continue;
      }
      const uint32_t* bits_row = pb + r * words;
      for (int64_t base = 0; base < vocab; base += 32) {
        const uint32_t bits = bits_row[base / 32];
        const int64_t n = std::min<int64_t>(32, vocab - base);
        if (bits == 0) {
          for (int64_t j = 0; j < n; ++j) dst[base + j] = neg_inf;
        } else {
          for (int64_t j = 0; j < n; ++j) dst[base + j] = ((bits >> j) & 1u) ? src[base + j] : neg_inf;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("grammar_masked_logits(Tensor logits, Tensor bitmask, Tensor rows) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("grammar_masked_logits", &grammar_masked_logits);
}
