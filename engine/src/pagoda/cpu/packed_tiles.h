// Shared machinery of the packed linear kernels (packed_linear*.cpp: bf16, int8, int4, fp8): the tile layout's
// constants, the broadcast dot products and row passes that accumulate a tile's float32 sums, the epilogues, and
// run_tiles, which splits tiles across ATen's thread pool and hands each finished tile to an epilogue. The layout
// and the kernels are described at the top of packed_linear.cpp; the ops' argument checks and output dispatch are
// in packed_dispatch.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGODA_BF16_DOT 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGODA_INT16_DOT 1
#endif

namespace pagoda_packed {

constexpr int64_t kLanes = 16;             // float32 sums per 512-bit register
constexpr int kNR = 4;                     // registers per tile row block
constexpr int64_t kTile = kLanes * kNR;    // 64 output rows per tile
constexpr int kMR = 6;                     // activation rows per pass: 24 accumulators
constexpr int64_t kChunkPairs = 256;       // k pairs per pass when rows need several passes (64 KB of bf16: L2)
constexpr int64_t kPrefetchPairs = 32;     // 8 KB ahead in the bf16 stream

// Lines of the next weight chunk that one row pass pulls into L2 while it computes on the current one. With
// several passes per chunk only the first would otherwise touch DRAM, in a burst at several times the
// average bandwidth; spreading the next chunk over all passes keeps the stream steady. lines == 0: the
// pass streams its own chunk instead (a single pass per chunk, as at decode).
struct Prefetch {
  const char* begin = nullptr;
  int64_t lines = 0;
  int64_t steps = 1;  // the pass's k pairs: its lines are spread evenly over them
  int64_t credit = 0;
  // Called once per k pair: issues lines/steps prefetches on average, without a division in the loop.
  inline void step() {
    for (credit += lines; credit >= steps; credit -= steps, begin += 64) _mm_prefetch(begin, _MM_HINT_T1);
  }
};

#if defined(PAGODA_BF16_DOT) || defined(PAGODA_INT16_DOT)
// A pass's float32 sums: MR rows x 64 outputs, resumed from acc unless this is the first k chunk.
template <int MR>
inline void load_sums(const float* acc, bool first, __m512 (&sum)[MR][kNR]) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kNR; ++j) sum[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + m * kTile + j * kLanes);
}

template <int MR>
inline void store_sums(const __m512 (&sum)[MR][kNR], float* acc) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kNR; ++j) _mm512_storeu_ps(acc + m * kTile + j * kLanes, sum[m][j]);
}
#endif

#ifdef PAGODA_BF16_DOT
// sum += pairwise bf16 dot of w with the pair *x in every lane. The pair is broadcast by the instruction from
// memory ({1to16}) instead of by a separate vpbroadcastd per row, which compilers keep: one uop fewer per row and
// k pair. With all 32 layer linears at 16-32 rows this ran 10-15% faster.
inline __m512 dot_broadcast(__m512 sum, __m512bh w, const uint32_t* x) {
  // x is passed as an address, not an "m" operand: GCC then kept the sum arrays in memory. The asm thus hides
  // its read from the compiler, which is safe because every activation buffer is complete before the
  // at::parallel_for that runs the passes (an opaque call no store can move past) and is only read after.
  asm("vdpbf16ps (%2)%{1to16%}, %1, %0" : "+v"(sum) : "v"(w), "r"(x));
  return sum;
}
#endif

#ifdef PAGODA_INT16_DOT
// isum += pairwise int16 dot of w with the pair *x in every lane, broadcast from memory as in the bf16 overload
// (packed_linear_int8.cpp's int16 activation pairs against widened int8 weights).
inline __m512i dot_broadcast(__m512i isum, __m512i w, const uint32_t* x) {
  asm("vpdpwssd (%2)%{1to16%}, %1, %0" : "+v"(isum) : "v"(w), "r"(x));
  return isum;
}
#endif

#ifdef PAGODA_BF16_DOT

// acc[m][64] (+)= x[m] . tile rows over pairs [p0, p1); x as bf16 pairs [MR][x_pairs]
template <int MR>
inline void bf16_pass(const uint32_t* x, int64_t x_pairs, const uint32_t* tile, int64_t p0, int64_t p1, float* acc,
                      bool first, Prefetch next) {
  __m512 sum[MR][kNR];
  load_sums<MR>(acc, first, sum);
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t* w = tile + p * kTile;
    __m512bh wv[kNR];
    if (next.lines == 0) {
      for (int j = 0; j < kNR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * kTile + j * kLanes), _MM_HINT_T0);
    } else {
      next.step();
    }
    for (int j = 0; j < kNR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * kLanes);
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kNR; ++j) sum[m][j] = dot_broadcast(sum[m][j], wv[j], x + m * x_pairs + p);
  }
  store_sums<MR>(sum, acc);
}
#endif

// Calls pass<MR'>(...) with MR' = min(rows, MR): remainders get their own register count.
template <template <int> class Pass, int MR, typename... Args>
inline void dispatch_rows(int64_t rows, Args... args) {
  if constexpr (MR > 1) {
    if (rows < MR) return dispatch_rows<Pass, MR - 1>(rows, args...);
  }
  Pass<MR>::run(args...);
}

#ifdef PAGODA_BF16_DOT
template <int MR>
struct Bf16Pass {
  static void run(const uint32_t* x, int64_t xp, const void* t, int64_t p0, int64_t p1, float* acc, bool first,
                  Prefetch next) {
    bf16_pass<MR>(x, xp, static_cast<const uint32_t*>(t), p0, p1, acc, first, next);
  }
};
#endif
// y[m, n0 + j] = acc[m][j] * col_scale[n0 + j] * row_scale[m] + bias[n0 + j] for one tile (scales and bias
// optional), rounded to scalar_t (the activation dtype) and stored as out_t: scalar_t, or float32 for logits,
// which then equal `y.float()` without a second pass over them. Vectorised for bf16: at 32 rows a scalar
// epilogue cost ~15% of a K=1024 tile's dot products.
template <typename scalar_t, typename out_t>
inline void store_tile(const float* acc, int64_t M, int64_t n0, const float* col_scale, const float* row_scale,
                       const float* bias, out_t* y, int64_t N) {
  const int64_t width = std::min(N - n0, kTile);
  for (int64_t m = 0; m < M; ++m) {
    const float rs = row_scale != nullptr ? row_scale[m] : 1.0f;
    int64_t j = 0;
#ifdef PAGODA_BF16_DOT
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      for (; j + 16 <= width; j += 16) {
        __m512 v = _mm512_loadu_ps(acc + m * kTile + j);
        if (col_scale != nullptr) v = _mm512_mul_ps(v, _mm512_mul_ps(_mm512_loadu_ps(col_scale + n0 + j), _mm512_set1_ps(rs)));
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + j));
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
        if constexpr (std::is_same_v<out_t, float>) {
          _mm512_storeu_ps(y + m * N + n0 + j, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + n0 + j), rounded);
        }
      }
    }
#endif
    for (; j < width; ++j) {
      float v = acc[m * kTile + j];
      if (col_scale != nullptr) v *= col_scale[n0 + j] * rs;
      if (bias != nullptr) v += bias[n0 + j];
      y[m * N + n0 + j] = static_cast<out_t>(static_cast<scalar_t>(v));
    }
  }
}

#ifdef PAGODA_BF16_DOT
// y[m, 32 t + j] = bf16(silu(g) * u) for tile t of a gated weight, which holds gate rows 32t .. 32t + 31 and then
// the same up rows: g and u are finished as store_tile finishes a value (scales and bias optional, bias in tile
// order) and rounded to bf16 first, so the result is exactly silu_and_mul over the plain kernel's bf16 output.
// Running the activation while the sums are in cache replaces a second pass over a [M, 2 * n] output (at 2048
// prefill rows that output is 25 MB per layer and the separate pass ran at ~8 GB/s).
inline void store_gated_tile(const float* acc, int64_t M, int64_t t, const float* col_scale, const float* row_scale,
                             const float* bias, at::BFloat16* y, int64_t n) {
  constexpr int64_t half = kTile / 2;
  const int64_t n0 = t * kTile;
  for (int64_t m = 0; m < M; ++m) {
    const __m512 rs = _mm512_set1_ps(row_scale != nullptr ? row_scale[m] : 1.0f);
    for (int64_t j = 0; j < half; j += kLanes) {
      __m512 g = _mm512_loadu_ps(acc + m * kTile + j), u = _mm512_loadu_ps(acc + m * kTile + half + j);
      if (col_scale != nullptr) {
        g = _mm512_mul_ps(g, _mm512_mul_ps(_mm512_loadu_ps(col_scale + n0 + j), rs));
        u = _mm512_mul_ps(u, _mm512_mul_ps(_mm512_loadu_ps(col_scale + n0 + half + j), rs));
      }
      if (bias != nullptr) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(bias + n0 + j));
        u = _mm512_add_ps(u, _mm512_loadu_ps(bias + n0 + half + j));
      }
      const __m512 h = pagoda_simd::silu_mul_bf16(pagoda_simd::round_bf16(g), pagoda_simd::round_bf16(u));
      pagoda_simd::store_bf16(y + m * n + t * half + j, h);
    }
  }
}

#endif

// Calls f(pass, first_row, rows) for the ceil(M / kMR) row passes over M rows, split evenly (32 rows:
// 6+6+5+5+5+5, not 6+6+6+6+6+2): a 2-row pass runs 8 dot products per 4 weight loads and is bound by the loads.
template <typename F>
inline void for_each_pass(int64_t M, F&& f) {
  const int64_t passes = (M + kMR - 1) / kMR, base_rows = M / passes, extra_rows = M % passes;
  for (int64_t i = 0, m0 = 0; i < passes; ++i) {
    const int64_t rows = base_rows + (i < extra_rows ? 1 : 0);
    f(i, m0, rows);
    m0 += rows;
  }
}

// epilogue(acc, t) for every tile t once acc [M][kTile] holds x . tile t's rows; x: [M][pairs] 32-bit pairs.
template <template <int> class Pass, typename Epilogue>
inline void run_tiles(const uint32_t* x, int64_t M, int64_t pairs, const char* packed, int64_t tile_bytes, int64_t tiles,
               const Epilogue& epilogue) {
  if (M == 0) return;
  const int64_t chunk = M <= kMR ? pairs : kChunkPairs;
  const int64_t passes = (M + kMR - 1) / kMR, pair_bytes = tile_bytes / pairs;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> acc(M * kTile);
    const char* range_end = packed + t_end * tile_bytes;
    for (int64_t t = t_begin; t < t_end; ++t) {
      const char* tile = packed + t * tile_bytes;
      for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
        const int64_t p1 = std::min(pairs, p0 + chunk);
        const char* next = tile + p1 * pair_bytes;  // the next chunk follows in memory, also across tiles
        const int64_t next_lines = passes > 1 ? (std::min(range_end - next, chunk * pair_bytes) + 63) / 64 : 0;
        const int64_t per_pass = (next_lines + passes - 1) / passes;
        for_each_pass(M, [&](int64_t i, int64_t m0, int64_t rows) {
          const Prefetch pf{next + i * per_pass * 64, std::max<int64_t>(0, std::min(per_pass, next_lines - i * per_pass)),
                            p1 - p0};
          dispatch_rows<Pass, kMR>(rows, x + m0 * pairs, pairs, static_cast<const void*>(tile), p0, p1,
                                   acc.data() + m0 * kTile, p0 == 0, pf);
        });
      }
      epilogue(acc.data(), t);
    }
  });
}

}  // namespace pagoda_packed
