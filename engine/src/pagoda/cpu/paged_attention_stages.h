// Stages of the native paged-attention kernel (paged_attention.cpp): one task is (request, KV head, tile of
// query tokens); its rows r = token * group + g are the query heads that share the KV head (GQA) for each
// token of the tile. Context tokens are visited in chunks of kKvChunk with an online (streaming) softmax:
//
//   scores (q . k, float32) -> softmax_chunk (running max/sum, probabilities) -> weighted sum of V rows.
//
// Two implementations of the scores and V stages:
// - float32 (every dtype): each K/V row is widened to float32 once per task and used by all rows; q . k
//   is a vector dot product with a horizontal sum per (row, token).
// - bf16 tiles (bf16 caches on AVX512-BF16): a chunk's K is transposed to [dim pairs][tokens] and its V
//   rows interleaved in token pairs, so vdpbf16ps produces 16 tokens' scores, or 16 output dims, per
//   instruction with no horizontal sums. The online softmax runs on the scores while they are still in
//   registers (score_rows). Probabilities enter the V sum rounded to bf16, as in
//   flash-attention kernels; scores, softmax and sums stay float32.
//
// fp8 caches (float8_e4m3fn / float8_e5m2, 1 byte per element) are widened exactly as they are loaded
// (fp8_to_half_bits): both stage families take their K/V rows through load16 / load32_bf16 overloads, and the
// per-tensor scales are folded into the softmax scale (K) and the final normalisation (V).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <immintrin.h>

#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGODA_ATTN_AVX512 1
#endif
#if defined(PAGODA_ATTN_AVX512) && defined(__AVX512BF16__)
#define PAGODA_ATTN_BF16_DOT 1
#endif

namespace pagoda_attention {

constexpr int64_t kQueryTile = 32;  // query tokens per task (prefill chunks); decode tasks have one
constexpr int64_t kKvChunk = 32;    // context tokens per online-softmax step
constexpr int64_t kMaxHeadDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows r = (token * kv_heads + h) * group + g: query head (kv_head + h) * group + g of query token
// first_query + token. Decode tasks take several KV heads (a token's K/V rows of neighbouring heads are
// adjacent in memory, so the task streams its blocks); prefill tasks take one head and a tile of tokens.
struct Task {
  int64_t req, kv_head, kv_heads, first_query;  // first_query: index within the request's queries
};

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;     // softmax scale, times the K scale of an fp8 cache (see attend)
  int64_t window;  // 0: unlimited
  float v_factor = 1.0f;  // multiplies each normalised output row: the V scale of an fp8 cache
};

// Dim index held by lane l of acc's 16-lane group g in the bf16 tile path (see pair_values).
inline int64_t paired_dim(int64_t g, int64_t l) { return (g / 2) * 32 + (g % 2) * 4 + 8 * (l / 4) + l % 4; }

#ifdef PAGODA_ATTN_AVX512
using pagoda_simd::exp_nonpositive;
using pagoda_simd::load16;

// ---- fp8 K/V ----------------------------------------------------------------------------------------------------
template <typename C>
constexpr bool is_fp8() {
  return std::is_same_v<C, at::Float8_e4m3fn> || std::is_same_v<C, at::Float8_e5m2>;
}

// What a value loaded through load16 must be multiplied by: e4m3fn rows are widened to value / 256 (see below).
template <typename C>
constexpr float kFp8ReadFactor = std::is_same_v<C, at::Float8_e4m3fn> ? 256.0f : 1.0f;

// 16 fp8 codes -> 16 fp16 bit patterns, integer ops only. e5m2 (s eeeee mm, bias 15) is the top byte of the fp16
// with the same value. e4m3fn (s eeee mmm, bias 7): its exponent and mantissa bits moved into fp16's fields give
// value * 2^(7 - 15), subnormals included (an e4m3 subnormal m * 2^-9 lands on the fp16 subnormal m * 2^-17), so
// the caller multiplies by kFp8ReadFactor; the NaN code (magnitude 0x7f) becomes fp16 NaN.
inline __m256i fp8_to_half_bits(__m128i codes, at::Float8_e5m2) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);
}
inline __m256i fp8_to_half_bits(__m128i codes, at::Float8_e4m3fn) {
  // sign-extended codes shifted by 7: bit 15 holds the sign, bit 14 a copy of it (cleared), bits 13..7 the rest
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7), _mm256_set1_epi16(-0x4080));
  const __m256i magnitude = _mm256_and_si256(h, _mm256_set1_epi16(0x3f80));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x3f80));
  return _mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7e00));
}
template <typename C, std::enable_if_t<is_fp8<C>(), int> = 0>
inline __m512 load16(const C* p) {
  return _mm512_cvtph_ps(fp8_to_half_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), C()));
}

// 16 float32 values -> fp8 codes of the format with kMantissa mantissa bits and exponent bias kBias: |x| saturated to
// max_finite, rounded to nearest (ties to even); NaN stays NaN. Normal results round the fp32 mantissa in the integer
// domain and rebias the exponent; below the smallest normal, adding 2^(24 - kBias - kMantissa) makes the FPU round
// |x| to the subnormal step, and the sum's low bits are the code.
template <int kMantissa, int kBias>
inline __m128i fp32_to_fp8(__m512 x, float max_finite, int nan_code) {
  constexpr int kShift = 23 - kMantissa;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(max_finite));
  const __m512i ab = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ab, kShift), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(((kBias - 127) << 23) + (1 << (kShift - 1)) - 1);
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ab, bias), odd), kShift);
  static_assert(24 - kBias - kMantissa > 0 && 24 - kBias - kMantissa < 31);
  const float magic = static_cast<float>(1 << (24 - kBias - kMantissa));
  const __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(a, _mm512_set1_ps(magic))),
                                             _mm512_castps_si512(_mm512_set1_ps(magic)));
  const __mmask16 below_normal = _mm512_cmplt_epi32_mask(ab, _mm512_set1_epi32((128 - kBias) << 23));
  __m512i code = _mm512_or_si512(_mm512_mask_mov_epi32(normal, below_normal, subnormal), sign);
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(nan_code));
  return _mm512_cvtepi32_epi8(code);
}
inline __m128i quantize16(__m512 x, at::Float8_e4m3fn) { return fp32_to_fp8<3, 7>(x, 448.0f, 0x7f); }
inline __m128i quantize16(__m512 x, at::Float8_e5m2) { return fp32_to_fp8<2, 15>(x, 57344.0f, 0x7e); }

// to[slots[t]] = fp8(from[t] / scale) for every token t: rows of `width` elements (a multiple of 16), `stride`
// elements apart in from. Dividing (not multiplying by 1 / scale) keeps the codes bit-equal to the torch path's.
template <typename T, typename C>
void quantize_rows(const T* from, int64_t stride, uint8_t* to, int64_t width, const int64_t* slots,
                   int64_t num_tokens, float scale) {
  const __m512 sv = _mm512_set1_ps(scale);
  at::parallel_for(0, num_tokens, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* src = from + t * stride;
      uint8_t* dst = to + slots[t] * width;
      for (int64_t i = 0; i < width; i += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), quantize16(_mm512_div_ps(load16(src + i), sv), C()));
    }
  });
}

// Running softmax state of a task's rows; scores hold one chunk, then its probabilities.
struct Rows {
  int64_t count = 0, dim = 0;
  int64_t heads = 1, group = 1;  // KV heads of the task, query heads per KV head
  float* acc = nullptr;     // [count][dim] unnormalised output
  float* scores = nullptr;  // [count][kKvChunk]
  float* max = nullptr;     // [count] running max score
  float* sum = nullptr;     // [count] running sum of exp(score - max)
  float* first = nullptr;   // [count] first visible position (float: positions stay far below 2^24)
  float* last = nullptr;    // [count] last visible position
  float* correction = nullptr;  // [count] bf16 tiles: the chunk's rescale of acc, applied in the V sums
};

// Masked scores (-inf) become 0; the rest exp(score - running max), and acc is rescaled to the new max.
inline void softmax_chunk(Rows& rows, int64_t r) {
  float* sr = rows.scores + r * kKvChunk;
  const __m512 s0 = _mm512_loadu_ps(sr), s1 = _mm512_loadu_ps(sr + 16);
  const float chunk_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
  if (chunk_max == kNegInf) {  // nothing visible to this row in the chunk
    std::fill(sr, sr + kKvChunk, 0.0f);
    return;
  }
  const float old_max = rows.max[r], new_max = std::max(old_max, chunk_max);
  const float correction = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
  const __m512 mv = _mm512_set1_ps(new_max), inf = _mm512_set1_ps(kNegInf);
  const __m512 p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, inf, _CMP_NEQ_OQ), exp_nonpositive(_mm512_sub_ps(s0, mv)));
  const __m512 p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, inf, _CMP_NEQ_OQ), exp_nonpositive(_mm512_sub_ps(s1, mv)));
  _mm512_storeu_ps(sr, p0);
  _mm512_storeu_ps(sr + 16, p1);
  rows.sum[r] = rows.sum[r] * correction + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  rows.max[r] = new_max;
  if (correction != 1.0f) {
    const __m512 cv = _mm512_set1_ps(correction);
    float* ar = rows.acc + r * rows.dim;
    for (int64_t d = 0; d < rows.dim; d += 16) _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), cv));
  }
}

// float32 path, scores: qf [count][dim] (scaled queries); k_rows[t] = K row of token c0 + t for the task's
// first KV head (head h's row follows h * dim elements later). kVecs = dim / 16 when known at compile time
// (0: read it from rows): with a constant the K/V vectors stay in registers instead of spilling to the stack.
template <typename T, int kVecs = 0>
void scores_f32(Rows& rows, const float* qf, const T* const* k_rows, int64_t c0, int64_t n) {
  const int64_t D = rows.dim, vecs = kVecs > 0 ? kVecs : D / 16, per_token = rows.heads * rows.group;
  for (int64_t t = 0; t < n; ++t) {
    const float pos = static_cast<float>(c0 + t);
    for (int64_t h = 0; h < rows.heads; ++h) {
      __m512 kv[kMaxHeadDim / 16];
      for (int64_t v = 0; v < vecs; ++v) kv[v] = load16(k_rows[t] + h * D + v * 16);
      for (int64_t base = h * rows.group; base < rows.count; base += per_token) {
        for (int64_t r = base; r < base + rows.group; ++r) {
          if (pos < rows.first[r] || pos > rows.last[r]) {
            rows.scores[r * kKvChunk + t] = kNegInf;
            continue;
          }
          __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qf + r * D), kv[0]);
          for (int64_t v = 1; v < vecs; ++v) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + r * D + v * 16), kv[v], dot);
          rows.scores[r * kKvChunk + t] = _mm512_reduce_add_ps(dot);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows.count; ++r) std::fill(rows.scores + r * kKvChunk + n, rows.scores + (r + 1) * kKvChunk, kNegInf);
}

// float32 path, V: acc_r += p_r[t] * v_t (v_rows like k_rows in scores_f32).
template <typename T, int kVecs = 0>
void values_f32(Rows& rows, const T* const* v_rows, int64_t n) {
  const int64_t D = rows.dim, vecs = kVecs > 0 ? kVecs : D / 16, per_token = rows.heads * rows.group;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < rows.heads; ++h) {
      __m512 vv[kMaxHeadDim / 16];
      for (int64_t v = 0; v < vecs; ++v) vv[v] = load16(v_rows[t] + h * D + v * 16);
      for (int64_t base = h * rows.group; base < rows.count; base += per_token) {
        for (int64_t r = base; r < base + rows.group; ++r) {
          const float p = rows.scores[r * kKvChunk + t];
          if (p == 0.0f) continue;
          const __m512 pv = _mm512_set1_ps(p);
          float* ar = rows.acc + r * D;
          for (int64_t v = 0; v < vecs; ++v) _mm512_storeu_ps(ar + v * 16, _mm512_fmadd_ps(pv, vv[v], _mm512_loadu_ps(ar + v * 16)));
        }
      }
    }
  }
}
#endif  // PAGODA_ATTN_AVX512

#ifdef PAGODA_ATTN_BF16_DOT
// out[j][i] = in[i][j] for a 16 x 16 block of 32-bit elements (in[i]: 16 pairs of one token).
inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane L: t[2k] = [r2k[4L], r2k+1[4L], r2k[4L+1], r2k+1[4L+1]]
    t[2 * k] = _mm512_unpacklo_epi32(in[2 * k], in[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(in[2 * k], in[2 * k + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane L: column 4L + c of rows 4g .. 4g + 3
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of u[c], u[4 + c], u[8 + c], u[12 + c] into column 4L + c
    const __m512i v02 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v13 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w02 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w13 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    out[c] = _mm512_shuffle_i32x4(v02, w02, 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(v02, w02, 0xDD);
    out[4 + c] = _mm512_shuffle_i32x4(v13, w13, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(v13, w13, 0xDD);
  }
}

// 32 cache elements from p as bf16 bits: bf16 rows as they are, fp8 rows widened (exact: every fp8 value, and every
// e4m3fn value / 256, is a bf16 value).
inline __m512i load32_bf16(const at::BFloat16* p) { return _mm512_loadu_si512(p); }
template <typename C, std::enable_if_t<is_fp8<C>(), int> = 0>
inline __m512i load32_bf16(const C* p) {
  return (__m512i)_mm512_cvtne2ps_pbh(load16(p + 16), load16(p));
}

// kt[p][t] = pair p of token t's K row ([dim/2][kKvChunk] 32-bit bf16 pairs); tokens >= n are zero. In 16 x 16
// blocks through registers: the scalar loop (a load and a store per pair) took ~12% of prefill attention.
template <typename C>
inline void transpose_keys(const C* const* k_rows, int64_t n, int64_t dim, uint32_t* kt) {
  const int64_t pairs = dim / 2;  // a multiple of 16: the tile path needs dim % 32 == 0
  __m512i in[16], out[16];
  for (int64_t t0 = 0; t0 < kKvChunk; t0 += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      for (int64_t i = 0; i < 16; ++i)
        in[i] = t0 + i < n ? load32_bf16(k_rows[t0 + i] + 2 * p0) : _mm512_setzero_si512();
      transpose16(in, out);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(kt + (p0 + j) * kKvChunk + t0, out[j]);
    }
  }
}

// vp[j] = V rows of tokens 2j and 2j+1 interleaved element by element (a missing second row is zero).
// Within each 32-dim block, 16-bit unpacks leave lane l of the low half at dim 8 * (l / 4) + l % 4 and
// of the high half at that + 4: acc keeps this order, finish_rows undoes it.
template <typename C>
inline void pair_values(const C* const* v_rows, int64_t n, int64_t dim, uint32_t* vp) {
  for (int64_t j = 0; 2 * j < n; ++j) {
    const C* a = v_rows[2 * j];
    const C* b = 2 * j + 1 < n ? v_rows[2 * j + 1] : nullptr;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i va = load32_bf16(a + d);
      const __m512i vb = b != nullptr ? load32_bf16(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + j * dim + d, _mm512_unpacklo_epi16(va, vb));
      _mm512_storeu_si512(vp + j * dim + d + 16, _mm512_unpackhi_epi16(va, vb));
    }
  }
}

// Scores, online softmax and bf16 probabilities of up to four rows at once, the scores never leaving
// registers: eight independent dot-product chains keep vdpbf16ps busy. Row r's scores row then starts with
// kKvChunk / 2 bf16 probability pairs, and rows.correction[r] holds the factor its acc still has to be
// rescaled by (value_block applies it as it loads acc). A separate softmax pass over stored scores, and its
// rescale of acc, took ~18% of prefill attention. q_rows[r]: row r's query as dim / 2 bf16 pairs, in place in q.
template <int RB>
inline void score_rows(Rows& rows, const uint32_t* const* q_rows, const uint32_t* kt, int64_t r0, int64_t c0,
                       float scale) {
  const int64_t pairs = rows.dim / 2;
  __m512 s[RB][2];
  const uint32_t* q[RB];
  for (int i = 0; i < RB; ++i) {
    s[i][0] = s[i][1] = _mm512_setzero_ps();
    q[i] = q_rows[r0 + i];
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * kKvChunk);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * kKvChunk + 16);
    for (int i = 0; i < RB; ++i) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[i][p]));
      s[i][0] = _mm512_dpbf16_ps(s[i][0], qv, k0);
      s[i][1] = _mm512_dpbf16_ps(s[i][1], qv, k1);
    }
  }
  const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 pos0 = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(c0)));
  const __m512 pos1 = _mm512_add_ps(pos0, _mm512_set1_ps(16.0f));
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < RB; ++i) {
    const int64_t r = r0 + i;
    // positions outside [first, last] (including tokens past the chunk) are masked out
    const __m512 lo = _mm512_set1_ps(rows.first[r]), hi = _mm512_set1_ps(rows.last[r]);
    const __mmask16 vis0 = _mm512_cmp_ps_mask(pos0, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(pos0, hi, _CMP_LE_OQ);
    const __mmask16 vis1 = _mm512_cmp_ps_mask(pos1, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(pos1, hi, _CMP_LE_OQ);
    uint32_t* probs = reinterpret_cast<uint32_t*>(rows.scores + r * kKvChunk);
    if ((vis0 | vis1) == 0) {  // nothing visible to this row in the chunk
      _mm512_storeu_si512(probs, _mm512_setzero_si512());
      rows.correction[r] = 1.0f;
      continue;
    }
    const __m512 s0 = _mm512_mask_blend_ps(vis0, _mm512_set1_ps(kNegInf), _mm512_mul_ps(s[i][0], sv));
    const __m512 s1 = _mm512_mask_blend_ps(vis1, _mm512_set1_ps(kNegInf), _mm512_mul_ps(s[i][1], sv));
    const float old_max = rows.max[r], new_max = std::max(old_max, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
    const float correction = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
    const __m512 mv = _mm512_set1_ps(new_max);
    const __m512 p0 = _mm512_maskz_mov_ps(vis0, exp_nonpositive(_mm512_sub_ps(s0, mv)));
    const __m512 p1 = _mm512_maskz_mov_ps(vis1, exp_nonpositive(_mm512_sub_ps(s1, mv)));
    rows.sum[r] = rows.sum[r] * correction + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    rows.max[r] = new_max;
    rows.correction[r] = correction;
    const __m256i b0 = (__m256i)_mm512_cvtneps_pbh(p0), b1 = (__m256i)_mm512_cvtneps_pbh(p1);
    _mm512_storeu_si512(probs, _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1));
  }
}

// Every row's chunk stage before the V sums (see score_rows).
inline void scores_bf16(Rows& rows, const uint32_t* const* q_rows, const uint32_t* kt, int64_t c0, float scale) {
  int64_t r = 0;
  for (; r + 4 <= rows.count; r += 4) score_rows<4>(rows, q_rows, kt, r, c0, scale);
  for (; r < rows.count; ++r) score_rows<1>(rows, q_rows, kt, r, c0, scale);
}

// acc[r0 + i][16 (g0 + g) ...] += sum_j pairs_r[j] . vp[j] for RB rows and G groups of 16 dims, the sums in
// registers: every V load feeds RB rows.
template <int RB, int G>
inline void value_block(Rows& rows, const uint32_t* vp, int64_t token_pairs, int64_t r0, int64_t g0) {
  const int64_t D = rows.dim;
  __m512 acc[RB][G];
  for (int i = 0; i < RB; ++i) {
    const __m512 correction = _mm512_set1_ps(rows.correction[r0 + i]);
    for (int g = 0; g < G; ++g) acc[i][g] = _mm512_mul_ps(_mm512_loadu_ps(rows.acc + (r0 + i) * D + (g0 + g) * 16), correction);
  }
  for (int64_t j = 0; j < token_pairs; ++j) {
    __m512bh pv[RB];
    for (int i = 0; i < RB; ++i) {
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(rows.scores + (r0 + i) * kKvChunk);
      pv[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[j]));
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + j * D + (g0 + g) * 16);
      for (int i = 0; i < RB; ++i) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], pv[i], v);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(rows.acc + (r0 + i) * D + (g0 + g) * 16, acc[i][g]);
}

template <int RB>
inline void value_rows(Rows& rows, const uint32_t* vp, int64_t token_pairs, int64_t r0) {
  const int64_t groups = rows.dim / 16;  // even: the tile path needs dim % 32 == 0
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) value_block<RB, 4>(rows, vp, token_pairs, r0, g);
  if (g < groups) value_block<RB, 2>(rows, vp, token_pairs, r0, g);
}

// acc_r = acc_r * correction_r + sum_t p_r[t] * v_t over token pairs, p_r the bf16 pairs score_rows left; acc
// in paired_dim order.
inline void values_bf16(Rows& rows, const uint32_t* vp, int64_t n) {
  const int64_t token_pairs = (n + 1) / 2;
  int64_t r = 0;
  for (; r + 4 <= rows.count; r += 4) value_rows<4>(rows, vp, token_pairs, r);
  for (; r < rows.count; ++r) value_rows<1>(rows, vp, token_pairs, r);
}
#endif  // PAGODA_ATTN_BF16_DOT

}  // namespace pagoda_attention
