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
// - int8 weights (weight-only quantization, per-row scale) run on AVX512-VNNI's int16 pairs
//   (vpdpwssd) against activations held as 16-bit fixed point per row (kActMax): finer than bf16's
//   mantissa near the row's maximum, and per row, so a request's result never depends on the rest
//   of its batch. int32 sums are flushed to float32 every kInt8ChunkPairs pairs (no overflow).
//
// Tiles are split across ATen's thread pool, the pool every other op of the engine uses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

namespace {

constexpr int64_t kLanes = 16;             // float32 sums per 512-bit register
constexpr int kNR = 4;                     // registers per tile row block
constexpr int64_t kTile = kLanes * kNR;    // 64 output rows per tile
constexpr int kMR = 6;                     // activation rows per pass: 24 accumulators
constexpr int64_t kChunkPairs = 256;       // k pairs per pass when rows need several passes (L1-resident)
constexpr int64_t kPrefetchPairs = 32;     // 8 KB ahead in the bf16 stream
constexpr int32_t kActMax = 16383;
constexpr int64_t kInt8ChunkPairs = 128;   // 256 products of |16383 * 127| per lane stay below 2^31

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

#ifdef PAGODA_INT16_DOT
// isum += pairwise int16 dot of w with the pair *x in every lane, broadcast from memory as in the bf16 kernel.
inline __m512i dot_broadcast(__m512i isum, __m512i w, const uint32_t* x) {
  asm("vpdpwssd (%2)%{1to16%}, %1, %0" : "+v"(isum) : "v"(w), "r"(x));
  return isum;
}

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
#ifdef PAGODA_INT16_DOT
template <int MR>
struct Int8Pass {
  static void run(const uint32_t* x, int64_t xp, const void* t, int64_t p0, int64_t p1, float* acc, bool first,
                  Prefetch) {
    int8_pass<MR>(x, xp, static_cast<const int8_t*>(t), p0, p1, acc, first);
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
void run_tiles(const uint32_t* x, int64_t M, int64_t pairs, const char* packed, int64_t tile_bytes, int64_t tiles,
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

at::Tensor float_bias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed linear runs on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2, "weight is not in packed layout");
  TORCH_CHECK(packed.is_contiguous(), "packed weight must be contiguous");
  TORCH_CHECK(N > 0 && N <= packed.size(0) * kTile, "N=", N, " does not fit the packed weight");
  TORCH_CHECK((x.size(-1) + 1) / 2 == packed.size(1), "x has ", x.size(-1), " features, the weight ",
              packed.size(1) * 2, " (padded)");
}

// [M, N] in x's dtype, or float32 with float_out
at::Tensor output_like(const at::Tensor& x, int64_t N, int64_t M, bool float_out) {
  return at::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());
}

at::Tensor view_output(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                       bool float_out) {
#ifdef PAGODA_BF16_DOT
  check_packed(x, packed, N);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_linear takes bf16");
  const int64_t K = x.size(-1), pairs = packed.size(1);
  auto x2 = x.reshape({-1, K});
  if (pairs * 2 != K) x2 = at::constant_pad_nd(x2, {0, pairs * 2 - K});
  x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  auto y = output_like(x, N, M, float_out);
  auto b = float_bias(bias);
  const auto* xp = reinterpret_cast<const uint32_t*>(x2.data_ptr());
  const auto* wp = static_cast<const char*>(packed.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t tile_bytes = pairs * kTile * 2 * 2;
  auto run = [&](auto* yp) {
    run_tiles<Bf16Pass>(xp, M, pairs, wp, tile_bytes, packed.size(0), [&](const float* acc, int64_t t) {
      store_tile<at::BFloat16>(acc, M, t * kTile, nullptr, nullptr, bp, yp, N);
    });
  };
  if (float_out) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<at::BFloat16>());
  }
  return view_output(y, x, N);
#else
  TORCH_CHECK(false, "bf16_linear needs AVX512-BF16, which this build lacks");
#endif
}

#ifdef PAGODA_BF16_DOT
// y[m, 32 t + j] = bf16(silu(g) * u) with g, u = acc[m][j], acc[m][32 + j] (+ bias), each rounded to bf16 first:
// exactly silu_and_mul over this GEMM's bf16 output. Tile t of a gated weight holds gate rows 32t .. 32t + 31
// and then the same up rows, so the activation runs while the sums are in cache instead of as a second pass
// over a [M, 2 * n] output (at 2048 prefill rows that output is 25 MB per layer and the pass ran at ~8 GB/s).
inline void store_gated_tile(const float* acc, int64_t M, int64_t t, const float* bias, at::BFloat16* y, int64_t n) {
  constexpr int64_t half = kTile / 2;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < half; j += kLanes) {
      __m512 g = _mm512_loadu_ps(acc + m * kTile + j), u = _mm512_loadu_ps(acc + m * kTile + half + j);
      if (bias != nullptr) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(bias + t * kTile + j));
        u = _mm512_add_ps(u, _mm512_loadu_ps(bias + t * kTile + half + j));
      }
      const __m512 h = pagoda_simd::silu_mul_bf16(pagoda_simd::round_bf16(g), pagoda_simd::round_bf16(u));
      pagoda_simd::store_bf16(y + m * n + t * half + j, h);
    }
  }
}
#endif

// silu(x W_gate^T + b_gate) * (x W_up^T + b_up) -> [..., n] for a packed gated weight (2n rows in the order
// store_gated_tile reads; the bias, if any, in that order too), rounded like bf16_linear then silu_and_mul.
at::Tensor bf16_silu_mul_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const std::optional<at::Tensor>& bias) {
#ifdef PAGODA_BF16_DOT
  check_packed(x, packed, 2 * n);
  TORCH_CHECK(n % (kTile / 2) == 0 && packed.size(0) * kTile == 2 * n, "a gated weight holds 2n rows, n % 32 == 0");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_silu_mul_linear takes bf16");
  const int64_t K = x.size(-1), pairs = packed.size(1);
  auto x2 = x.reshape({-1, K});
  if (pairs * 2 != K) x2 = at::constant_pad_nd(x2, {0, pairs * 2 - K});
  x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  auto y = at::empty({M, n}, x.options());
  auto b = float_bias(bias);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  run_tiles<Bf16Pass>(reinterpret_cast<const uint32_t*>(x2.data_ptr()), M, pairs, static_cast<const char*>(packed.data_ptr()),
                      pairs * kTile * 2 * 2, packed.size(0),
                      [&](const float* acc, int64_t t) { store_gated_tile(acc, M, t, bp, yp, n); });
  return view_output(y, x, n);
#else
  TORCH_CHECK(false, "bf16_silu_mul_linear needs AVX512-BF16, which this build lacks");
#endif
}

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

// y = (x @ q^T) * col_scale + bias for bf16 x: [M][pairs] bf16 pairs.
template <typename out_t>
void int8_widened_tiles(const uint32_t* x, int64_t M, int64_t pairs, const int8_t* packed, int64_t tiles,
                        const float* col_scale, const float* bias, out_t* y, int64_t N) {
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
      store_tile<at::BFloat16>(acc.data(), M, t * kTile, col_scale, static_cast<const float*>(nullptr), bias, y, N);
    }
  });
}
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                       const std::optional<at::Tensor>& bias, bool float_out) {
#ifdef PAGODA_INT16_DOT
  check_packed(x, packed, N);
  TORCH_CHECK(packed.scalar_type() == at::kChar, "int8_linear takes an int8 packed weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N, "scales must be [N] float32");
  const int64_t K = x.size(-1), pairs = packed.size(1);
  auto s = scales.contiguous();
  auto b = float_bias(bias);
#if defined(PAGODA_BF16_DOT) && defined(PAGODA_INT16_DOT)
  if (x.scalar_type() == at::kBFloat16 && x.numel() / std::max<int64_t>(K, 1) >= kInt8WidenRows) {
    auto xb = x.reshape({-1, K});
    if (pairs * 2 != K) xb = at::constant_pad_nd(xb, {0, pairs * 2 - K});
    xb = xb.contiguous();
    auto y = output_like(x, N, xb.size(0), float_out);
    const auto* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr());
    const auto* wp = static_cast<const int8_t*>(packed.data_ptr());
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    if (float_out) {
      int8_widened_tiles(xp, xb.size(0), pairs, wp, packed.size(0), s.data_ptr<float>(), bp, y.data_ptr<float>(), N);
    } else {
      int8_widened_tiles(xp, xb.size(0), pairs, wp, packed.size(0), s.data_ptr<float>(), bp,
                         y.data_ptr<at::BFloat16>(), N);
    }
    return view_output(y, x, N);
  }
#endif
  auto x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();  // [M, K] fp32 (a few KB at decode)
  const int64_t M = x2.size(0);
  auto a = at::empty({M, pairs * 2}, x.options().dtype(at::kShort));
  auto row_scale = at::empty({M}, x.options().dtype(at::kFloat));
  quantize_rows(x2.data_ptr<float>(), M, K, pairs * 2, a.data_ptr<int16_t>(), row_scale.data_ptr<float>());
  auto y = output_like(x, N, M, float_out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    const auto* ap = reinterpret_cast<const uint32_t*>(a.data_ptr());
    const auto* wp = static_cast<const char*>(packed.data_ptr());
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    const float* cs = s.data_ptr<float>();
    const float* rs = row_scale.data_ptr<float>();
    auto run = [&](auto* yp) {
      run_tiles<Int8Pass>(ap, M, pairs, wp, pairs * kTile * 2, packed.size(0), [&](const float* acc, int64_t t) {
        store_tile<scalar_t>(acc, M, t * kTile, cs, rs, bp, yp, N);
      });
    };
    if (float_out) {
      run(y.data_ptr<float>());
    } else {
      run(y.data_ptr<scalar_t>());
    }
  });
  return view_output(y, x, N);
#else
  TORCH_CHECK(false, "int8_linear needs AVX512-VNNI, which this build lacks");
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
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("packed_linear_support() -> int", &packed_linear_support);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_weight);
  m.impl("unpack_linear_weight", &unpack_weight);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_silu_mul_linear", &bf16_silu_mul_linear);
  m.impl("int8_linear", &int8_linear);
}
