// Batched multi-LoRA for one linear layer on CPU: every run of rows that share an adapter slot gets
// out[rows] += (x[rows] A_slot^T) B_slot^T, for all runs and all output slices in one call.
//
// Layouts (pagoda.lora.layers.LinearLoRA, native mode):
//   x       [rows, in]                   the layer's input (unit stride along in)
//   lora_a  [slots, S * R, in]           slice s's A in rows s*R .. s*R + rank (zero past the rank)
//   lora_bt [slots, R, out]              B transposed: column j of slice s uses ranks 0..rank of row k
//   out     [rows, out]                  the base layer's output, updated in place
// runs: (slot, first row, end row, rank) per run; slices: the output slice sizes (summing to out).
//
// In PyTorch each segment costs two small GEMMs (~25-60 us each, mostly dispatch and packing); a decode
// step of 32 requests over 4 adapters of the Qwen3-0.6B shape made 896 of them. Here one call covers a
// layer: the shrink streams each A row once for up to kRowBlock rows of its run (one accumulator each), the
// expand converts a 16-column B tile to float32 once and reuses it for every row of the run. Only the
// adapter's own rank is computed, not the slot's padded width. The delta is accumulated in float32 and added
// to out with one rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGODA_LORA_AVX512 1
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRowBlock = 8;  // rows whose dot products share one pass over an A row

template <typename T>
inline float f(T v) {
  return static_cast<float>(v);
}

struct Run {
  int64_t slot, start, end, rank;
};

struct Shape {
  int64_t in, out, max_rank, num_slices;
};

// dst[i] = float(src[i]) for n elements.
template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGODA_LORA_AVX512
  for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(dst + i, pagoda_simd::load16(src + i));
#endif
  for (; i < n; ++i) dst[i] = f(src[i]);
}

// sums[r] = x[r] . a over n elements, for nr (<= kRowBlock) rows of x (row stride x_stride), float32 sums.
template <typename T>
void dot_rows(const T* x, int64_t x_stride, int64_t nr, const T* a, int64_t n, float* sums) {
  int64_t i = 0;
  for (int64_t r = 0; r < nr; ++r) sums[r] = 0.0f;
#ifdef PAGODA_LORA_AVX512
  __m512 acc[kRowBlock];
  for (int64_t r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 av = pagoda_simd::load16(a + i);
    for (int64_t r = 0; r < nr; ++r) acc[r] = _mm512_fmadd_ps(pagoda_simd::load16(x + r * x_stride + i), av, acc[r]);
  }
  for (int64_t r = 0; r < nr; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
#endif
  for (; i < n; ++i) {
    const float av = f(a[i]);
    for (int64_t r = 0; r < nr; ++r) sums[r] += f(x[r * x_stride + i]) * av;
  }
}

// shrunk[row][s * R + k] = x[row] . A[slot][s * R + k] for each run row, slice and k < rank.
template <typename T>
void shrink(const T* x, int64_t x_stride, const T* a, const std::vector<Run>& runs, const Shape& shape,
            float* shrunk) {
  const int64_t width = shape.num_slices * shape.max_rank;
  // units of work: (run, first row of a row block, A row), each a pass over one A row for up to kRowBlock rows
  std::vector<std::tuple<const Run*, int64_t, int64_t>> units;
  for (const Run& run : runs)
    for (int64_t row = run.start; row < run.end; row += kRowBlock)
      for (int64_t s = 0; s < shape.num_slices; ++s)
        for (int64_t k = 0; k < run.rank; ++k) units.emplace_back(&run, row, s * shape.max_rank + k);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 4, [&](int64_t b, int64_t e) {
    float sums[kRowBlock];
    for (int64_t u = b; u < e; ++u) {
      const auto [run, row, column] = units[u];
      const int64_t nr = std::min(kRowBlock, run->end - row);
      const T* a_row = a + (run->slot * width + column) * shape.in;
      dot_rows(x + row * x_stride, x_stride, nr, a_row, shape.in, sums);
      for (int64_t r = 0; r < nr; ++r) shrunk[(row + r) * width + column] = sums[r];
    }
  });
}

#ifdef PAGODA_LORA_AVX512
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// float32 -> bf16 rounding to nearest even (as c10::BFloat16 does; NaN stays NaN), without AVX512-BF16
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
#endif

// out[row][j .. j + n) += sum_k shrunk[row][s * R + k] * Bt[slot][k][j .. j + n) for one column block of a slice.
template <typename T>
void expand_block(const float* shrunk, const T* bt_slot, const Run& run, const Shape& shape, int64_t slice_column,
                  int64_t j, int64_t n, T* out, int64_t out_stride, float* tile) {
  const int64_t width = shape.num_slices * shape.max_rank;
  for (int64_t k = 0; k < run.rank; ++k) {  // the B tile in float32, once for all rows of the run
    const T* b = bt_slot + k * shape.out + j;
    if (n == kLanes) {
      to_float(b, tile + k * kLanes, kLanes);
    } else {
      for (int64_t t = 0; t < kLanes; ++t) tile[k * kLanes + t] = t < n ? f(b[t]) : 0.0f;
    }
  }
  for (int64_t row = run.start; row < run.end; ++row) {
    const float* s_row = shrunk + row * width + slice_column;
    T* o = out + row * out_stride + j;
#ifdef PAGODA_LORA_AVX512
    if (n == kLanes) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < run.rank; ++k)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(s_row[k]), _mm512_loadu_ps(tile + k * kLanes), acc);
      store16(o, _mm512_add_ps(pagoda_simd::load16(o), acc));
      continue;
    }
#endif
    float acc[kLanes] = {0.0f};
    for (int64_t k = 0; k < run.rank; ++k)
      for (int64_t t = 0; t < kLanes; ++t) acc[t] += s_row[k] * tile[k * kLanes + t];
    for (int64_t t = 0; t < n; ++t) o[t] = static_cast<T>(f(o[t]) + acc[t]);
  }
}

template <typename T>
void lora_add_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                   const std::vector<Run>& runs, const std::vector<int64_t>& slices, const Shape& shape) {
  const int64_t width = shape.num_slices * shape.max_rank;
  std::vector<float> shrunk(static_cast<size_t>(x.size(0) * width), 0.0f);
  shrink<T>(x.data_ptr<T>(), x.stride(0), lora_a.data_ptr<T>(), runs, shape, shrunk.data());
  // column blocks: (slice, first column, width), each within one slice
  std::vector<std::tuple<int64_t, int64_t, int64_t>> blocks;
  int64_t offset = 0;
  for (int64_t s = 0; s < shape.num_slices; ++s) {
    for (int64_t j = 0; j < slices[s]; j += kLanes) blocks.emplace_back(s, offset + j, std::min(kLanes, slices[s] - j));
    offset += slices[s];
  }
  const T* bt = lora_bt.data_ptr<T>();
  T* po = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 8, [&](int64_t b, int64_t e) {
    std::vector<float> tile(static_cast<size_t>(shape.max_rank * kLanes));
    for (int64_t i = b; i < e; ++i) {
      const auto [s, j, n] = blocks[i];
      for (const Run& run : runs) {
        const T* bt_slot = bt + run.slot * shape.max_rank * shape.out;
        expand_block<T>(shrunk.data(), bt_slot, run, shape, s * shape.max_rank, j, n, po, out.stride(0), tile.data());
      }
    }
  });
}

void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
              at::IntArrayRef runs, at::IntArrayRef slices) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0), "out [rows, out] and x [rows, in]");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1, "out and x need unit stride along their last dimension");
  TORCH_CHECK(lora_a.is_contiguous() && lora_bt.is_contiguous(), "the slot buffers must be contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && x.scalar_type() == lora_a.scalar_type() &&
                  lora_a.scalar_type() == lora_bt.scalar_type(),
              "out, x and the slots must share one dtype");
  TORCH_CHECK(runs.size() % 4 == 0, "runs are (slot, start, end, rank) quadruples");
  const Shape shape{x.size(1), out.size(1), lora_bt.size(1), static_cast<int64_t>(slices.size())};
  TORCH_CHECK(lora_a.size(1) == shape.num_slices * shape.max_rank && lora_a.size(2) == shape.in, "lora_a shape");
  TORCH_CHECK(lora_bt.size(2) == shape.out, "lora_bt shape");
  std::vector<Run> parsed;
  for (size_t i = 0; i < runs.size(); i += 4) {
    const Run run{runs[i], runs[i + 1], runs[i + 2], runs[i + 3]};
    TORCH_CHECK(run.slot >= 0 && run.slot < lora_a.size(0), "slot out of range");
    TORCH_CHECK(0 <= run.start && run.start <= run.end && run.end <= x.size(0), "run rows out of range");
    TORCH_CHECK(parsed.empty() || parsed.back().end <= run.start, "runs must be in row order, not overlapping");
    TORCH_CHECK(0 <= run.rank && run.rank <= shape.max_rank, "rank out of range");
    parsed.push_back(run);
  }
  std::vector<int64_t> sizes(slices.begin(), slices.end());
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  TORCH_CHECK(total == shape.out, "the slices must sum to out's width");
  switch (x.scalar_type()) {
    case at::kFloat:
      lora_add_impl<float>(out, x, lora_a, lora_bt, parsed, sizes, shape);
      break;
    case at::kBFloat16:
      lora_add_impl<at::BFloat16>(out, x, lora_a, lora_bt, parsed, sizes, shape);
      break;
    case at::kHalf:
      lora_add_impl<at::Half>(out, x, lora_a, lora_bt, parsed, sizes, shape);
      break;
    default:
      TORCH_CHECK(false, "lora_add_ serves float32, bfloat16 and float16, not ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_bt, int[] runs, int[] slices) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("lora_add_", &lora_add); }
