// Weight-only FP8 (e4m3fn) linear layers on the packed tile layout (see packed_linear.cpp for the layout):
// y = (x @ q^T) * scale[n] + bias[n] with q e4m3fn, one float32 scale per output row and bf16 activations.
//
// The CPU has no FP8 arithmetic, but every e4m3fn value (subnormals included) is a bf16 value, so the kernel
// stores one byte per weight (half of bf16's) and widens it to bf16 exactly in registers: two 128-entry byte
// tables (vpermi2b, AVX512-VBMI) give the low and high byte of each value's bf16 pattern from its 7 magnitude
// bits, the sign bit is copied over, and vpunpck{l,h}bw interleaves the bytes into bf16 words. vdpbf16ps then
// runs against the bf16 activations as the bf16 kernel does, and the row scale (and bias) are applied in the
// epilogue.
//
// Byte order. vpunpck{l,h}bw interleave within 128-bit lanes, so each 64-byte half of a k pair's 128 bytes
// (32 rows x 2 values) is stored so that the interleave yields the natural order: the byte of row pair word w
// (0..31) of register q (0: rows 0-15 of the half, 1: rows 16-31) sits at 16 * (w / 8) + 8 * q + w % 8
// (fp8_cpu.py's pack_fp8_weight; tile layout and padding as pack_linear_weight's otherwise).
//
// Up to kFp8FusedRows rows (decode) the row passes widen each weight line in registers as they stream it; from
// there every chunk of a tile is widened once into a bf16 buffer in cache and all row passes run the bf16 kernel
// on it, while the source bytes of the next chunk are prefetched across those passes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include <immintrin.h>

#include "packed_dispatch.h"

namespace {

// Whether this build (compiled for this machine) has the fp8 kernels, which fp8_linear_support() reports: they
// widen with vpermi2b (AVX512-VBMI) and run vdpbf16ps.
#if defined(PAGODA_BF16_DOT) && defined(__AVX512VBMI__)
#define PAGODA_FP8_WIDEN 1
constexpr bool kFp8Kernels = true;
#else
constexpr bool kFp8Kernels = false;
#endif

using namespace pagoda_packed;

// The bf16 bit pattern of the e4m3fn value with magnitude bits mag (sign 0): 2^(e-7) * (1 + m/8) for e > 0,
// m * 2^-9 for e == 0 (normal in bf16), NaN for 0x7f.
constexpr uint16_t e4m3_magnitude_as_bf16(int mag) {
  const int e = mag >> 3, m = mag & 7;
  if (mag == 0x7f) return 0x7fc0;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));
  if (m == 0) return 0;
  const int top = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m = 2^top * (1 + fraction)
  return static_cast<uint16_t>(((118 + top) << 7) | ((m - (1 << top)) << (7 - top)));
}

// lo[mag], hi[mag]: the two bytes of e4m3_magnitude_as_bf16(mag), each as two 64-entry vpermi2b tables
struct alignas(64) WidenTables {
  std::array<uint8_t, 128> lo{}, hi{};
};

constexpr WidenTables make_widen_tables() {
  WidenTables t;
  for (int mag = 0; mag < 128; ++mag) {
    t.lo[mag] = static_cast<uint8_t>(e4m3_magnitude_as_bf16(mag) & 0xff);
    t.hi[mag] = static_cast<uint8_t>(e4m3_magnitude_as_bf16(mag) >> 8);
  }
  return t;
}

constexpr WidenTables kWidenTables = make_widen_tables();
static_assert(e4m3_magnitude_as_bf16(0x38) == 0x3f80, "1.0");
static_assert(e4m3_magnitude_as_bf16(0x7e) == 0x43e0, "448");
static_assert(e4m3_magnitude_as_bf16(0x01) == 0x3b00, "2^-9, the smallest subnormal");
static_assert(e4m3_magnitude_as_bf16(0x07) == 0x3c60, "7 * 2^-9, the largest subnormal");

// Up to this many rows every row pass widens the weights in registers (more than kMR rows: each pass re-widens
// its chunk, which stays in L1/L2). From there each chunk is widened once into cache and the passes run the bf16
// kernel on it. Qwen3-0.6B layer linears x 14, one thread, in registers vs widened once: 8 rows 23-25 vs 27-30
// ms, 16 rows 40-47 vs 42-46, 24 rows 55-58 vs 61-64, 32 rows 79-84 vs 77-82 (bf16: 27, 41, 57, 74).
constexpr int64_t kFp8FusedRows = 24;
constexpr int64_t kFp8ChunkPairs = kChunkPairs;  // k pairs widened into cache at a time (64 KB of bf16: L2)
constexpr int64_t kFp8PrefetchPairs = 64;  // 8 KB ahead in the fp8 stream (the bf16 kernel's distance in bytes)
constexpr int64_t kPairBytes = kTile * 2;  // one k pair of a tile: 64 rows x 2 e4m3 bytes

#ifdef PAGODA_FP8_WIDEN
struct Widener {
  __m512i lo_a, lo_b, hi_a, hi_b, sign;

  Widener()
      : lo_a(_mm512_load_si512(kWidenTables.lo.data())),
        lo_b(_mm512_load_si512(kWidenTables.lo.data() + 64)),
        hi_a(_mm512_load_si512(kWidenTables.hi.data())),
        hi_b(_mm512_load_si512(kWidenTables.hi.data() + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}

  // 64 stored bytes (one half of a k pair: 32 rows x 2) -> w0 (rows 0-15) and w1 (rows 16-31) as bf16 pairs
  inline void widen(__m512i src, __m512i& w0, __m512i& w1) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo_a, src, lo_b);  // index bit 7 (the sign) is ignored
    __m512i hi = _mm512_permutex2var_epi8(hi_a, src, hi_b);
    hi = _mm512_ternarylogic_epi32(hi, src, sign, 0xf8);  // hi | (src & 0x80)
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

// acc[m][64] (+)= x[m] . tile rows over pairs [p0, p1), widening each weight line in registers as it arrives
template <int MR>
inline void fp8_pass(const uint32_t* x, int64_t x_pairs, const uint8_t* tile, int64_t p0, int64_t p1, float* acc,
                     bool first, Prefetch next) {
  const Widener widener;
  __m512 sum[MR][kNR];
  load_sums<MR>(acc, first, sum);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* w = tile + p * kPairBytes;
    if (next.lines == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kFp8PrefetchPairs * kPairBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kFp8PrefetchPairs * kPairBytes + 64), _MM_HINT_T0);
    } else {
      next.step();
    }
    for (int h = 0; h < 2; ++h) {  // rows 32h .. 32h + 31
      __m512i w0, w1;
      widener.widen(_mm512_loadu_si512(w + h * 64), w0, w1);
      for (int m = 0; m < MR; ++m) {
        sum[m][2 * h] = dot_broadcast(sum[m][2 * h], (__m512bh)w0, x + m * x_pairs + p);
        sum[m][2 * h + 1] = dot_broadcast(sum[m][2 * h + 1], (__m512bh)w1, x + m * x_pairs + p);
      }
    }
  }
  store_sums<MR>(sum, acc);
}

template <int MR>
struct Fp8Pass {
  static void run(const uint32_t* x, int64_t xp, const void* t, int64_t p0, int64_t p1, float* acc, bool first,
                  Prefetch next) {
    fp8_pass<MR>(x, xp, static_cast<const uint8_t*>(t), p0, p1, acc, first, next);
  }
};

// n_pairs stored k pairs of a tile -> the same pairs as bf16 in the bf16 kernel's layout ([n_pairs][64] pairs)
inline void widen_chunk(const uint8_t* src, int64_t n_pairs, uint32_t* out) {
  const Widener widener;
  for (int64_t p = 0; p < n_pairs; ++p) {
    for (int h = 0; h < 2; ++h) {
      __m512i w0, w1;
      widener.widen(_mm512_loadu_si512(src + p * kPairBytes + h * 64), w0, w1);
      _mm512_storeu_si512(out + p * kTile + 2 * h * kLanes, w0);
      _mm512_storeu_si512(out + p * kTile + (2 * h + 1) * kLanes, w1);
    }
  }
}

// epilogue(acc, t) for every tile t of x . q^T from kFp8FusedRows + 1 rows: each chunk widened once into cache,
// all row passes on it, the next chunk's bytes prefetched over those passes. x: [M][pairs] bf16 pairs.
template <typename Epilogue>
void fp8_widened_tiles(const uint32_t* x, int64_t M, int64_t pairs, const uint8_t* packed, int64_t tiles,
                       const Epilogue& epilogue) {
  const int64_t passes = (M + kMR - 1) / kMR, tile_bytes = pairs * kPairBytes;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> acc(M * kTile);
    std::vector<uint32_t> wide(kFp8ChunkPairs * kTile);
    const uint8_t* range_end = packed + t_end * tile_bytes;
    for (int64_t t = t_begin; t < t_end; ++t) {
      const uint8_t* tile = packed + t * tile_bytes;
      for (int64_t p0 = 0; p0 < pairs; p0 += kFp8ChunkPairs) {
        const int64_t n_pairs = std::min(kFp8ChunkPairs, pairs - p0);
        widen_chunk(tile + p0 * kPairBytes, n_pairs, wide.data());
        const uint8_t* next = tile + (p0 + n_pairs) * kPairBytes;  // the next chunk, also across tiles
        const int64_t next_lines = (std::min<int64_t>(range_end - next, kFp8ChunkPairs * kPairBytes) + 63) / 64;
        const int64_t per_pass = (next_lines + passes - 1) / passes;
        for_each_pass(M, [&](int64_t i, int64_t m0, int64_t rows) {
          const Prefetch pf{reinterpret_cast<const char*>(next) + i * per_pass * 64,
                            std::max<int64_t>(0, std::min(per_pass, next_lines - i * per_pass)), n_pairs};
          dispatch_rows<Bf16Pass, kMR>(rows, x + m0 * pairs + p0, pairs, static_cast<const void*>(wide.data()),
                                       int64_t{0}, n_pairs, acc.data() + m0 * kTile, p0 == 0, pf);
        });
      }
      epilogue(acc.data(), t);
    }
  });
}

// epilogue(acc, t) for every tile t of x . q^T (unscaled float32 sums), x: [..., K] bf16
template <typename Epilogue>
void fp8_tiles(const at::Tensor& x, const at::Tensor& packed, const Epilogue& epilogue) {
  const int64_t pairs = packed.size(1), tiles = packed.size(0);
  const auto x2 = padded_rows(x, pairs);
  const int64_t M = x2.size(0);
  if (M == 0) return;
  const auto* xp = reinterpret_cast<const uint32_t*>(x2.data_ptr());
  const auto* wp = static_cast<const uint8_t*>(packed.data_ptr());
  if (M <= kFp8FusedRows) {
    run_tiles<Fp8Pass>(xp, M, pairs, reinterpret_cast<const char*>(wp), pairs * kPairBytes, tiles, epilogue);
  } else {
    fp8_widened_tiles(xp, M, pairs, wp, tiles, epilogue);
  }
}

void check_fp8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, "the fp8 kernels take a packed weight of e4m3fn bytes (uint8)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == N, "scales must be [", N, "] float32");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "the fp8 kernels take bf16 activations");
}
#endif

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                      const std::optional<at::Tensor>& bias, bool float_out) {
#ifdef PAGODA_FP8_WIDEN
  check_packed(x, packed, N);
  check_fp8(x, packed, scales, N);
  const ScaledEpilogue e(scales, bias, N);
  const float *cs = e.col_scale, *bp = e.bias_data;
  const int64_t M = row_count(x);
  return linear_output<at::BFloat16>(x, N, M, float_out, [&](auto* yp) {
    fp8_tiles(x, packed, [&](const float* acc, int64_t t) {
      store_tile<at::BFloat16>(acc, M, t * kTile, cs, nullptr, bp, yp, N);
    });
  });
#else
  missing_isa("fp8_linear", "AVX512-BF16 and AVX512-VBMI");
#endif
}

// silu(gate) * up -> [..., n] for a gated fp8 weight (packed, scales and bias in store_gated_tile's tile order),
// rounded like fp8_linear then silu_and_mul.
at::Tensor fp8_silu_mul_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                               const std::optional<at::Tensor>& bias) {
#ifdef PAGODA_FP8_WIDEN
  check_gated(x, packed, n);
  check_fp8(x, packed, scales, 2 * n);
  const ScaledEpilogue e(scales, bias, 2 * n);
  const float *cs = e.col_scale, *bp = e.bias_data;
  const int64_t M = row_count(x);
  return gated_output(x, n, M, [&](at::BFloat16* yp) {
    fp8_tiles(x, packed, [&](const float* acc, int64_t t) {
      store_gated_tile(acc, M, t, cs, nullptr, bp, yp, n);
    });
  });
#else
  missing_isa("fp8_silu_mul_linear", "AVX512-BF16 and AVX512-VBMI");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("fp8_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("fp8_silu_mul_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias) -> Tensor");
  m.def("fp8_linear_support() -> bool", [] { return kFp8Kernels; });
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("fp8_linear", &fp8_linear);
  m.impl("fp8_silu_mul_linear", &fp8_silu_mul_linear);
}
