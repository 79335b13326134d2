// Group-quantized integer linear layers (AWQ / GPTQ, 4 and 8 bits) on AVX512-BF16 with bf16 activations:
// y[m, n] = sum_k x[m, k] * (q[n, k] - z[g, n]) * s[g, n] + bias[n], g = k / group_size.
//
// Layout (packed by pagoda.layers.int4_cpu.pack_int_weight): tiles of 64 output rows as in packed_linear.cpp,
// each one sequential stream of blocks, one block per group:
//
//   block: [64 scales float32 (256 B) or float16 (128 B)][64 zero points uint8 (64 B)][group pairs x 64 B nibbles]
//
// float16 scales where they are exact (AWQ and GPTQ checkpoints store float16): 3 bytes per row and group instead
// of 5, which a decode step reads as well (at group 32, 0.59 instead of 0.66 bytes per weight).
//
// One k pair of a tile (64 rows x 2 k) is 128 nibbles = one 64-byte line, read as 32 words: nibble j of word i
// is row 16 j + i / 2, k 2p + i % 2, so register j of the bf16 kernel (rows 16j..16j+15, lane = one row's k pair)
// is word i's nibble j, moved to bits 3..6 and ORed with 0x4180: the bf16 of 16 + q, exact. The dot products
// thus sum x * (q + 16); per group that partial sum P is folded into the row's float32 total as
//   total += P * s - (z + 16) * s * xsum[m, g]      (xsum: the row's activations summed over the group)
// so the zero point costs two FMAs per group and row, not one per weight. Every product is exact and the sums are
// float32, so the result is the float32 reference up to summation order before its one rounding to bf16.
//
// 8 bits: each k is a "pair" of its high and low nibble, the high one ORed with 0x4380 (bf16 of 256 + 16 h),
// against the activation duplicated (x_k, x_k): one dot product adds x_k * (q + 272), the same kernel, at twice the
// dot products per weight. That is free at decode (memory bound); for more rows each chunk is widened once to the
// exact bf16 q of real k pairs, which every pass then reads as the bf16 kernel does (offset 0).
//
// Decode (<= kMR rows) reads the weight once, in one pass. More rows run in passes of kMR rows over chunks of
// about kInt4ChunkPairs pairs that stay in L2, each pass unpacking the nibbles again (cheap beside its 24 dot
// products per pair); the next chunk is prefetched across the passes as in run_tiles (packed_tiles.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include <immintrin.h>

#include "packed_dispatch.h"

namespace {

using namespace pagoda_packed;

constexpr int64_t kMetaBytes32 = kTile * 4 + kTile;  // float32 scales + zero points ahead of a group's lines
constexpr int64_t kMetaBytes16 = kTile * 2 + kTile;  // float16 scales + zero points
constexpr int64_t kLineBytes = 64;                  // one k pair of a tile
constexpr int64_t kInt4ChunkPairs = 512;            // multi-pass chunk: 32 KB of nibbles, L2 resident across passes
constexpr int64_t kInt4PrefetchLines = 64;          // single pass: lines ahead of the one being read (4 KB)

// What one call's tiles share: the activations, their group sums and the weight's geometry.
struct Int4Problem {
  const uint32_t* x;   // [M][pairs] bf16 pairs (8 bits without widen8: each value twice)
  const float* xsum;   // [M][groups] float32 sums of each row's activations over each group
  int64_t M, pairs, groups;
  int64_t group_pairs;  // pairs of x per group: what a pass loops over
  int64_t group_lines;  // 64-byte lines per group and tile: group / 2, 8 bits group (one per k)
  int64_t block_bytes, meta_bytes;
  bool half_scales;    // float16 scales (meta_bytes == kMetaBytes16)
  bool widen8;         // 8 bits, many rows: chunks widened to exact bf16 k pairs (widen_8bit_chunk)
  uint32_t high_or;    // the bf16 exponent ORed onto a lane's (odd k | even k) halves: 0x41804180, 8 bits 0x41804380
  float offset;        // what the encoding adds to q: 16, 8 bits 272
};

#ifdef PAGODA_BF16_DOT
// The four bf16 registers (rows 16j..16j+15, pairs of k) of one 64-byte line of nibbles.
inline void unpack_line(const uint8_t* line, __m512i mask, __m512i ors, __m512bh (&w)[kNR]) {
  const __m512i v = _mm512_loadu_si512(line);  // 32 words of 4 nibbles
  // (a & mask) | ors = ternary logic 0xEA on (a, mask, ors): the nibble at bits 3..6 under the bf16 exponent
  w[0] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mask, ors, 0xEA);
  w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mask, ors, 0xEA);
  w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), mask, ors, 0xEA);
  w[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), mask, ors, 0xEA);
}

// total[m][64] (+)= the group's sums of x[m] * (w + offset), corrected and scaled (see the top of the file).
template <int MR>
inline void fold_group(const __m512 (&part)[MR][kNR], const uint8_t* block, bool half_scales, const float* xsum,
                       int64_t groups, float offset, float* acc, bool first) {
  const uint8_t* z = block + kTile * (half_scales ? 2 : 4);
  __m512 sv[kNR], cv[kNR];
  for (int j = 0; j < kNR; ++j) {
    sv[j] = half_scales ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block) + j))
                        : _mm512_loadu_ps(reinterpret_cast<const float*>(block) + j * kLanes);
    const __m128i zb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(z + j * kLanes));
    const __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(zb));
    cv[j] = _mm512_mul_ps(_mm512_add_ps(zf, _mm512_set1_ps(offset)), sv[j]);  // (z + offset) * s
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 xs = _mm512_set1_ps(xsum[m * groups]);
    for (int j = 0; j < kNR; ++j) {
      float* a = acc + m * kTile + j * kLanes;
      __m512 t = _mm512_fmadd_ps(part[m][j], sv[j], first ? _mm512_setzero_ps() : _mm512_loadu_ps(a));
      _mm512_storeu_ps(a, _mm512_fnmadd_ps(cv[j], xs, t));
    }
  }
}

// acc[m][64] (+)= x[m] . the tile's rows over groups [g0, g1), MR rows; acc starts at zero when g0 == 0.
// Unpacking a line costs 8 simple ops beside 4 MR dot products, which ran at the dot products' peak from 4 rows on
// (2-core Zen 4): a bf16 copy of each chunk unpacked once for all passes (as int8 widens its tiles) was not faster.
// Wide: the weights come from `wide`, the chunk's bf16 registers (widen_8bit_chunk).
template <int MR, bool Wide>
inline void int4_pass(const Int4Problem* pr, const uint32_t* x, const float* xsum, const uint8_t* tile,
                      const uint32_t* wide, int64_t g0, int64_t g1, float* acc, Prefetch next) {
  const __m512i mask = _mm512_set1_epi32(0x00780078), ors = _mm512_set1_epi32(static_cast<int>(pr->high_or));
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* block = tile + g * pr->block_bytes;
    const uint8_t* lines = block + pr->meta_bytes;
    const uint32_t* xg = x + g * pr->group_pairs;
    __m512 part[MR][kNR];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kNR; ++j) part[m][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pr->group_pairs; ++p) {
      __m512bh w[kNR];
      if constexpr (Wide) {
        next.step();
        const uint32_t* wp = wide + ((g - g0) * pr->group_pairs + p) * kTile;
        for (int j = 0; j < kNR; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wp + j * kLanes);
      } else {
        const uint8_t* line = lines + p * kLineBytes;
        if (next.lines == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(line + kInt4PrefetchLines * kLineBytes), _MM_HINT_T0);
        } else {
          next.step();
        }
        unpack_line(line, mask, ors, w);
      }
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < kNR; ++j) part[m][j] = dot_broadcast(part[m][j], w[j], xg + m * pr->pairs + p);
    }
    fold_group<MR>(part, block, pr->half_scales, xsum + g, pr->groups, pr->offset, acc, g == 0);
  }
}

template <int MR>
struct Int4Pass {
  template <typename... Args>
  static void run(Args... args) { int4_pass<MR, false>(args...); }
};

template <int MR>
struct Int4WidePass {
  template <typename... Args>
  static void run(Args... args) { int4_pass<MR, true>(args...); }
};

// q of register j's 16 rows as float32 from an 8-bit line: dword r holds row r's high nibble in its low word and
// its low nibble in its high word, each at nibble j; vpmaddwd forms 16 h + l.
inline __m512 line_q(__m512i v, int j) {
  const __m512i nibbles = _mm512_and_si512(_mm512_srli_epi16(v, 4 * j), _mm512_set1_epi32(0x000F000F));
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(nibbles, _mm512_set1_epi32(0x00010010)));
}

// Groups [g0, g1) of an 8-bit tile as the bf16 kernel's registers: [pairs][64] lanes of (q[2p], q[2p + 1]), exact
// (q < 256 has 8 significant bits, so the float32's low 16 bits are zero and its high half is the bf16).
void widen_8bit_chunk(const Int4Problem& pr, const uint8_t* tile, int64_t g0, int64_t g1, uint32_t* wide) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* lines = tile + g * pr.block_bytes + pr.meta_bytes;
    for (int64_t p = 0; p < pr.group_pairs; ++p, wide += kTile) {
      const __m512i even = _mm512_loadu_si512(lines + 2 * p * kLineBytes);
      const __m512i odd = _mm512_loadu_si512(lines + (2 * p + 1) * kLineBytes);
      for (int j = 0; j < kNR; ++j) {
        const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(line_q(even, j)), 16);
        _mm512_storeu_si512(wide + j * kLanes, _mm512_or_si512(lo, _mm512_castps_si512(line_q(odd, j))));
      }
    }
  }
}

// epilogue(acc, t) for every tile t once acc [M][kTile] holds the finished float32 sums of tile t's rows.
template <typename Epilogue>
void int4_tiles(const Int4Problem& pr, const uint8_t* packed, int64_t tiles, const Epilogue& epilogue) {
  if (pr.M == 0) return;
  const int64_t tile_bytes = pr.groups * pr.block_bytes;
  const int64_t chunk_pairs = pr.widen8 ? kChunkPairs : kInt4ChunkPairs;  // widened: 64 KB of bf16 as in run_tiles
  const int64_t chunk = pr.M <= kMR ? pr.groups : std::max<int64_t>(1, chunk_pairs / pr.group_pairs);
  const int64_t passes = (pr.M + kMR - 1) / kMR;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> acc(pr.M * kTile);
    std::vector<uint32_t> wide(pr.widen8 ? chunk * pr.group_pairs * kTile : 0);
    const uint8_t* range_end = packed + t_end * tile_bytes;
    for (int64_t t = t_begin; t < t_end; ++t) {
      const uint8_t* tile = packed + t * tile_bytes;
      for (int64_t g0 = 0; g0 < pr.groups; g0 += chunk) {
        const int64_t g1 = std::min(pr.groups, g0 + chunk);
        if (pr.widen8) widen_8bit_chunk(pr, tile, g0, g1, wide.data());
        const uint8_t* next = tile + g1 * pr.block_bytes;  // the next chunk follows, also across tiles
        const int64_t next_bytes = std::min<int64_t>(range_end - next, chunk * pr.block_bytes);
        const int64_t next_lines = passes > 1 ? (next_bytes + 63) / 64 : 0;
        const int64_t per_pass = (next_lines + passes - 1) / passes;
        for_each_pass(pr.M, [&](int64_t i, int64_t m0, int64_t rows) {
          const Prefetch pf{reinterpret_cast<const char*>(next) + i * per_pass * 64,
                            std::max<int64_t>(0, std::min(per_pass, next_lines - i * per_pass)),
                            std::max<int64_t>(1, (g1 - g0) * pr.group_pairs)};
          const uint32_t* xm = pr.x + m0 * pr.pairs;
          const float* xs = pr.xsum + m0 * pr.groups;
          const uint32_t* w = wide.data();
          if (pr.widen8) {
            dispatch_rows<Int4WidePass, kMR>(rows, &pr, xm, xs, tile, w, g0, g1, acc.data() + m0 * kTile, pf);
          } else {
            dispatch_rows<Int4Pass, kMR>(rows, &pr, xm, xs, tile, w, g0, g1, acc.data() + m0 * kTile, pf);
          }
        });
      }
      epilogue(acc.data(), t);
    }
  });
}

// Rows of activation work (K values each) per thread: the sums and copies below are a small fraction of the GEMM, and
// below this much work a second parallel region costs more than it saves (on a busy host every region waits for
// its slowest thread).
inline int64_t row_grain(int64_t K) { return std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(K, 1)); }

// xsum[m][g] = float32 sum of x[m, g * group .. (g + 1) * group); x: [M, K] bf16 rows
void group_sums(const at::BFloat16* x, int64_t M, int64_t K, int64_t group, float* xsum) {
  const int64_t groups = K / group;
  at::parallel_for(0, M, row_grain(K), [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      for (int64_t g = 0; g < groups; ++g) {
        const at::BFloat16* xg = x + m * K + g * group;
        __m512 v = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + kLanes <= group; k += kLanes) v = _mm512_add_ps(v, pagoda_simd::load16(xg + k));
        float sum = _mm512_reduce_add_ps(v);
        for (; k < group; ++k) sum += static_cast<float>(xg[k]);
        xsum[m * groups + g] = sum;
      }
    }
  });
}

// [M, K] bf16 -> [M, K] 32-bit lanes holding each value twice (the 8-bit layout's pairs)
at::Tensor duplicated_rows(const at::Tensor& x2) {
  const int64_t M = x2.size(0), K = x2.size(1);
  auto out = at::empty({M, K}, x2.options().dtype(at::kInt));
  const auto* src = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, M, row_grain(K), [&](int64_t m_begin, int64_t m_end) {
    for (int64_t i = m_begin * K; i < m_end * K; ++i) dst[i] = static_cast<uint32_t>(src[i]) * 0x10001u;
  });
  return out;
}

// Checks a call's shapes and returns what its tiles share; holders keeps the tensors its pointers read.
Int4Problem prepare(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t group, int64_t bits,
                    std::vector<at::Tensor>& holders) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "the int4 kernels run on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "the int4 kernels take bf16 activations");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous [tiles, tile_bytes] uint8 tensor");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t K = x.size(-1);
  TORCH_CHECK(group > 0 && K % group == 0 && (bits == 8 || group % 2 == 0), "group size ", group,
              " does not fit K=", K);
  Int4Problem pr{};
  pr.groups = K / group;
  pr.group_lines = bits == 4 ? group / 2 : group;
  // the scales' width is what the tile size leaves beside the nibbles
  pr.meta_bytes = packed.size(1) % pr.groups == 0 ? packed.size(1) / pr.groups - pr.group_lines * kLineBytes : -1;
  TORCH_CHECK(pr.meta_bytes == kMetaBytes32 || pr.meta_bytes == kMetaBytes16, "packed tiles hold ", packed.size(1),
              " bytes, which K=", K, " at group ", group, " does not fit");
  pr.half_scales = pr.meta_bytes == kMetaBytes16;
  pr.block_bytes = pr.meta_bytes + pr.group_lines * kLineBytes;
  TORCH_CHECK(N > 0 && N <= packed.size(0) * kTile, "N=", N, " does not fit the packed weight");
  const auto x2 = x.reshape({-1, K}).contiguous();
  pr.M = x2.size(0);
  pr.widen8 = bits == 8 && pr.M > kMR && group % 2 == 0;
  pr.group_pairs = bits == 4 || pr.widen8 ? group / 2 : group;
  pr.pairs = pr.groups * pr.group_pairs;
  auto xsum = at::empty({pr.M, pr.groups}, x.options().dtype(at::kFloat));
  group_sums(x2.data_ptr<at::BFloat16>(), pr.M, K, group, xsum.data_ptr<float>());
  const auto xp = bits == 4 || pr.widen8 ? x2 : duplicated_rows(x2);
  pr.x = reinterpret_cast<const uint32_t*>(xp.data_ptr());
  pr.xsum = xsum.data_ptr<float>();
  pr.high_or = bits == 4 ? 0x41804180u : 0x41804380u;
  pr.offset = bits == 4 ? 16.0f : pr.widen8 ? 0.0f : 272.0f;
  holders = {xp, xsum};
  return pr;
}
#endif

// x [..., K] bf16 -> [..., N]: bf16, or float32 holding the bf16 rounding (float_out, one pass).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t group, int64_t bits,
                       const std::optional<at::Tensor>& bias, bool float_out) {
#ifdef PAGODA_BF16_DOT
  std::vector<at::Tensor> holders;
  const Int4Problem pr = prepare(x, packed, N, group, bits, holders);
  const auto b = float_bias(bias, N);
  const float* bp = float_data_or_null(b);
  return linear_output<at::BFloat16>(x, N, pr.M, float_out, [&](auto* yp) {
    int4_tiles(pr, packed.data_ptr<uint8_t>(), packed.size(0), [&](const float* acc, int64_t t) {
      store_tile<at::BFloat16>(acc, pr.M, t * kTile, nullptr, nullptr, bp, yp, N);
    });
  });
#else
  missing_isa("int4_linear", "AVX512-BF16");
#endif
}

// silu(gate) * up -> [..., n] for a gated weight (2n rows, scales, zeros and bias in store_gated_tile's order),
// rounded like int4_linear then silu_and_mul.
at::Tensor int4_silu_mul_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t group, int64_t bits,
                                const std::optional<at::Tensor>& bias) {
#ifdef PAGODA_BF16_DOT
  check_gated_rows(packed, n);
  std::vector<at::Tensor> holders;
  const Int4Problem pr = prepare(x, packed, 2 * n, group, bits, holders);
  const auto b = float_bias(bias, 2 * n);
  const float* bp = float_data_or_null(b);
  return gated_output(x, n, pr.M, [&](at::BFloat16* yp) {
    int4_tiles(pr, packed.data_ptr<uint8_t>(), packed.size(0),
               [&](const float* acc, int64_t t) { store_gated_tile(acc, pr.M, t, nullptr, nullptr, bp, yp, n); });
  });
#else
  missing_isa("int4_silu_mul_linear", "AVX512-BF16");
#endif
}

// Which group-quantized kernels this build can run: bit 0 four bits, bit 1 eight bits.
int64_t int4_linear_support() {
#ifdef PAGODA_BF16_DOT
  return 3;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "int4_linear(Tensor x, Tensor packed, int n, int group_size, int bits, Tensor? bias, bool float_out=False) "
      "-> Tensor");
  m.def("int4_silu_mul_linear(Tensor x, Tensor packed, int n, int group_size, int bits, Tensor? bias) -> Tensor");
  m.def("int4_linear_support() -> int", &int4_linear_support);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_silu_mul_linear", &int4_silu_mul_linear);
}
