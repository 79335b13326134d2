// Weight-only int8 linear layers on the packed tile layout (see packed_linear.cpp for the layout):
// y = (x @ q^T) * scale[n] + bias[n] with q int8 and one float32 scale per output row.
//
// Up to kInt8WidenRows - 1 rows, the int8 weights run on AVX512-VNNI's int16 pairs (vpdpwssd) against
// activations held as 16-bit fixed point per row (kActMax): finer than bf16's mantissa near the row's maximum,
// and per row, so a request's result never depends on the rest of its batch. int32 sums are flushed to float32
// every kInt8ChunkPairs pairs (no overflow). From kInt8WidenRows bf16 rows on (prefill), each weight chunk is
// widened to bf16 in cache and runs the bf16 kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <immintrin.h>

#include "packed_dispatch.h"

namespace {

using namespace pagoda_packed;

constexpr int32_t kActMax = 16383;
constexpr int64_t kInt8ChunkPairs = 128;   // 256 products of |16383 * 127| per lane stay below 2^31

#ifdef PAGODA_INT16_DOT
// acc[m][64] (+)= x[m] . tile rows over pairs [p0, p1): int16 activation pairs x int8 weights
template <int MR>
inline void int8_pass(const uint32_t* x, int64_t x_pairs, const int8_t* tile, int64_t p0, int64_t p1, float* acc,
                      bool first) {
  __m512 sum[MR][kNR];
  load_sums<MR>(acc, first, sum);
  for (int64_t c0 = p0; c0 < p1; c0 += kInt8ChunkPairs) {
    const int64_t c1 = std::min(p1, c0 + kInt8ChunkPairs);
    __m512i isum[MR][kNR];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kNR; ++j) isum[m][j] = _mm512_setzero_si512();
    for (int64_t p = c0; p < c1; ++p) {
      const int8_t* w = tile + p * kTile * 2;
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * kTile * 2), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * kTile * 2 + 64), _MM_HINT_T0);
      __m512i wv[kNR];
      for (int j = 0; j < kNR; ++j)
        wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * kLanes * 2)));
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < kNR; ++j) isum[m][j] = dot_broadcast(isum[m][j], wv[j], x + m * x_pairs + p);
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kNR; ++j) sum[m][j] = _mm512_add_ps(sum[m][j], _mm512_cvtepi32_ps(isum[m][j]));
  }
  store_sums<MR>(sum, acc);
}
#endif

#ifdef PAGODA_INT16_DOT
template <int MR>
struct Int8Pass {
  static void run(const uint32_t* x, int64_t xp, const void* t, int64_t p0, int64_t p1, float* acc, bool first,
                  Prefetch) {
    int8_pass<MR>(x, xp, static_cast<const int8_t*>(t), p0, p1, acc, first);
  }
};
#endif

// Per row: a = round(x / s) with s = max|x| / kActMax (s = 0 for an all-zero row); padded k stays 0.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t K_padded, int16_t* a, float* row_scale) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(x[m * K + k]));
    const float inv = amax > 0.0f ? kActMax / amax : 0.0f;
    row_scale[m] = amax / kActMax;
    for (int64_t k = 0; k < K; ++k) a[m * K_padded + k] = static_cast<int16_t>(std::nearbyint(x[m * K + k] * inv));
    for (int64_t k = K; k < K_padded; ++k) a[m * K_padded + k] = 0;
  }
}

#if defined(PAGODA_BF16_DOT) && defined(PAGODA_INT16_DOT)
// From this many bf16 activation rows, each int8 tile chunk is widened to bf16 once (exact: |q| <= 127) and
// every row pass runs vdpbf16ps on it with the activations as they are. All Qwen3-0.6B layer linears, int16
// path vs widened: 16 rows 40-43 vs 56-63 ms, 32 rows 75-78 vs 95, 128 rows 284-287 vs 294-298, 256 rows
// 572-578 vs 547-555, 512 rows 1.15-1.21 s vs 1.09-1.11 s.
constexpr int64_t kInt8WidenRows = 192;

// count int8 values (a multiple of 32) -> count bf16 values, same order
inline void widen_int8(const int8_t* q, int64_t count, uint32_t* out) {
  for (int64_t i = 0; i < count; i += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i + 16))));
    _mm512_storeu_si512(out + i / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// epilogue(acc, t) for every tile t of x . q^T with bf16 x: [M][pairs] bf16 pairs (unscaled sums).
template <typename Epilogue>
void int8_widened_tiles(const uint32_t* x, int64_t M, int64_t pairs, const int8_t* packed, int64_t tiles,
                        const Epilogue& epilogue) {
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> acc(M * kTile);
    std::vector<uint32_t> wide(kChunkPairs * kTile);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int8_t* tile = packed + t * pairs * kTile * 2;
      for (int64_t p0 = 0; p0 < pairs; p0 += kChunkPairs) {
        const int64_t n_pairs = std::min(kChunkPairs, pairs - p0);
        widen_int8(tile + p0 * kTile * 2, n_pairs * kTile * 2, wide.data());
        for_each_pass(M, [&](int64_t, int64_t m0, int64_t rows) {
          dispatch_rows<Bf16Pass, kMR>(rows, x + m0 * pairs + p0, pairs, static_cast<const void*>(wide.data()),
                                       int64_t{0}, n_pairs, acc.data() + m0 * kTile, p0 == 0, Prefetch{});
        });
      }
      epilogue(acc.data(), t);
    }
  });
}
#endif

#ifdef PAGODA_INT16_DOT
// epilogue(acc, t, row_scale) for every tile t of x . q^T, x: [M, K] in any float dtype, acc: [M][kTile] sums
// still to be scaled by the tile's column scales and by row_scale[m], which is nullptr where x is used as it is
// (bf16 from kInt8WidenRows rows: widened tiles) and each row's 16-bit fixed-point step otherwise.
template <typename Epilogue>
void int8_tiles(const at::Tensor& x, const at::Tensor& packed, const Epilogue& epilogue) {
  const int64_t K = x.size(-1), pairs = packed.size(1), tiles = packed.size(0);
#if defined(PAGODA_BF16_DOT)
  if (x.scalar_type() == at::kBFloat16 && x.numel() / std::max<int64_t>(K, 1) >= kInt8WidenRows) {
    const auto xb = padded_rows(x, pairs);
    int8_widened_tiles(reinterpret_cast<const uint32_t*>(xb.data_ptr()), xb.size(0), pairs,
                       static_cast<const int8_t*>(packed.data_ptr()), tiles,
                       [&](const float* acc, int64_t t) { epilogue(acc, t, static_cast<const float*>(nullptr)); });
    return;
  }
#endif
  auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();  // [M, K] fp32 (a few KB at decode)
  const int64_t M = x2.size(0);
  auto a = at::empty({M, pairs * 2}, x.options().dtype(at::kShort));
  auto row_scale = at::empty({M}, x.options().dtype(at::kFloat));
  quantize_rows(x2.data_ptr<float>(), M, K, pairs * 2, a.data_ptr<int16_t>(), row_scale.data_ptr<float>());
  const float* rs = row_scale.data_ptr<float>();
  run_tiles<Int8Pass>(reinterpret_cast<const uint32_t*>(a.data_ptr()), M, pairs,
                      static_cast<const char*>(packed.data_ptr()), pairs * kTile * 2, tiles,
                      [&](const float* acc, int64_t t) { epilogue(acc, t, rs); });
}

void check_int8(const at::Tensor& packed, const at::Tensor& scales, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "the int8 kernels take an int8 packed weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N, "scales must be [N] float32");
}
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                       const std::optional<at::Tensor>& bias, bool float_out) {
#ifdef PAGODA_INT16_DOT
  check_packed(x, packed, N);
  check_int8(packed, scales, N);
  const ScaledEpilogue e(scales, bias, N);
  const float *cs = e.col_scale, *bp = e.bias_data;
  const int64_t M = row_count(x);
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    return linear_output<scalar_t>(x, N, M, float_out, [&](auto* yp) {
      int8_tiles(x, packed, [&](const float* acc, int64_t t, const float* rs) {
        store_tile<scalar_t>(acc, M, t * kTile, cs, rs, bp, yp, N);
      });
    });
  });
#else
  missing_isa("int8_linear", "AVX512-VNNI");
#endif
}

// silu(gate) * up -> [..., n] for a gated int8 weight (packed, scales and bias in store_gated_tile's tile order),
// rounded like int8_linear then silu_and_mul; bf16 activations.
at::Tensor int8_silu_mul_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                                const std::optional<at::Tensor>& bias) {
#if defined(PAGODA_INT16_DOT) && defined(PAGODA_BF16_DOT)
  check_gated(x, packed, n);
  check_int8(packed, scales, 2 * n);
  const ScaledEpilogue e(scales, bias, 2 * n);
  const float *cs = e.col_scale, *bp = e.bias_data;
  const int64_t M = row_count(x);
  return gated_output(x, n, M, [&](at::BFloat16* yp) {
    int8_tiles(x, packed, [&](const float* acc, int64_t t, const float* rs) {
      store_gated_tile(acc, M, t, cs, rs, bp, yp, n);
    });
  });
#else
  missing_isa("int8_silu_mul_linear", "AVX512-VNNI and AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("int8_silu_mul_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_silu_mul_linear", &int8_silu_mul_linear);
}
