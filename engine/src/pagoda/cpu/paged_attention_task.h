// One task of the native paged-attention kernel (paged_attention.cpp builds the tasks and runs them across threads):
// attend lays out the task's rows, streams its visible context through the stages (paged_attention_stages.h) chunk
// by chunk of K/V rows read in place from their blocks, and writes the normalised rows to the output.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "paged_attention_stages.h"

namespace pagoda_attention {

#ifdef PAGODA_ATTN_AVX512
// The bf16 tile stages pay a per-chunk transpose that only tasks with a few rows amortize.
constexpr int64_t kMinTileRows = 4;

struct Work {
  std::vector<float> floats;
  std::vector<uint32_t> words;
  std::vector<const uint32_t*> q_rows;
};

template <typename T>
constexpr bool is_bf16() {
  return std::is_same_v<T, at::BFloat16>;
}

// Lays out a task's rows and their visible ranges; returns [lo, hi), the positions any row sees.
template <typename T>
std::pair<int64_t, int64_t> setup_rows(Rows& rows, const Task& task, const T* q, int64_t query_start, int64_t q_len,
                                       int64_t seq_len, const Shape& s, Work& work, bool tiles, float*& qf) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim;
  const int64_t count = std::min(kQueryTile, q_len - task.first_query) * task.kv_heads * group;
  work.floats.resize(count * (2 * D + kKvChunk + 5));
  float* f = work.floats.data();
  rows = Rows{count, D, task.kv_heads, group, f, f + count * D, f + count * (D + kKvChunk), nullptr, nullptr, nullptr};
  rows.sum = rows.max + count;
  rows.first = rows.sum + count;
  rows.last = rows.first + count;
  rows.correction = rows.last + count;
  qf = rows.correction + count;  // [count][D], float32 path only
  if (tiles) {
    work.words.resize((D / 2) * kKvChunk + (kKvChunk / 2) * D);
    work.q_rows.resize(count);
  }
  // A token's rows are the query heads kv_head * group onwards, adjacent in q: nested loops, no division
  // per row (runtime divisions per row were a measurable share of short prefill tasks).
  const int64_t per_token = task.kv_heads * group, tokens = count / per_token;
  int64_t lo = seq_len, hi = 0;
  for (int64_t tok = 0, r = 0; tok < tokens; ++tok) {
    const int64_t token = task.first_query + tok, pos = seq_len - q_len + token;
    const int64_t begin = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
    lo = std::min(lo, begin);
    hi = std::max(hi, pos + 1);
    const T* q_token = q + ((query_start + token) * s.num_heads + task.kv_head * group) * D;
    for (int64_t j = 0; j < per_token; ++j, ++r) {
      const T* qr = q_token + j * D;
      if (tiles) {  // read in place: copying 16 KB of rows per task took ~4% of prefill attention
        work.q_rows[r] = reinterpret_cast<const uint32_t*>(qr);
      } else {
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qr[d]) * s.scale;
      }
      rows.first[r] = static_cast<float>(begin);
      rows.last[r] = static_cast<float>(pos);
      rows.max[r] = kNegInf;
      rows.sum[r] = 0.0f;
    }
  }
  std::fill(rows.acc, rows.acc + count * D, 0.0f);
  return {lo, hi};
}

#ifdef PAGODA_ATTN_BF16_DOT
// orow = bf16(acc * inv) with acc in paired_dim order: per 32 dims, groups 2b and 2b + 1 hold dims
// {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31} (+32b); two permutes restore the order.
inline void store_paired_row(const float* acc, int64_t dim, float inv, at::BFloat16* orow) {
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512 a = _mm512_loadu_ps(acc + d), b = _mm512_loadu_ps(acc + d + 16);
    const __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(a, first, b), scale);
    const __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(a, second, b), scale);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d), (__m256i)_mm512_cvtneps_pbh(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d + 16), (__m256i)_mm512_cvtneps_pbh(hi));
  }
}
#endif

template <typename T>
void finish_rows(const Rows& rows, const Task& task, int64_t query_start, const Shape& s, bool tiles, T* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim, per_token = task.kv_heads * group;
  // rows of a token are adjacent heads in out, as in setup_rows
  T* out_rows = out + ((query_start + task.first_query) * s.num_heads + task.kv_head * group) * D;
  for (int64_t r = 0, j = 0; r < rows.count; ++r) {
    T* orow = out_rows + j * D;
    if (++j == per_token) {
      j = 0;
      out_rows += s.num_heads * D;
    }
    const float inv = rows.sum[r] > 0.0f ? s.v_factor / rows.sum[r] : 0.0f;
    const float* ar = rows.acc + r * D;
#ifdef PAGODA_ATTN_BF16_DOT
    if constexpr (is_bf16<T>()) {
      if (tiles) {
        store_paired_row(ar, D, inv, orow);
        continue;
      }
    }
#endif
    for (int64_t i = 0; i < D; ++i) {
      const int64_t d = tiles ? paired_dim(i / 16, i % 16) : i;
      orow[d] = static_cast<T>(ar[i] * inv);
    }
  }
}

template <typename T>
void prefetch_rows(const T* const* row_ptrs, int64_t n, int64_t dim) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row_ptrs[t]) + b, _MM_HINT_T0);
}

// offsets[t] = element offset of position c0 + t's row in a cache [blocks, block_size, kv_heads, dim] (token_stride =
// kv_heads * dim): walks the block table instead of dividing every position by the runtime block size.
inline void row_offsets(const int64_t* block_table, int64_t c0, int64_t n, int64_t block_size, int64_t token_stride,
                        int64_t* offsets) {
  if (n <= 0) return;
  int64_t block = c0 / block_size, within = c0 - block * block_size;
  int64_t base = block_table[block] * block_size;
  for (int64_t t = 0; t < n; ++t) {
    offsets[t] = (base + within) * token_stride;
    if (++within == block_size && t + 1 < n) {  // never reads a table entry past the last position
      within = 0;
      base = block_table[++block] * block_size;
    }
  }
}

// A task's first K rows, fetched while the thread still works on the task before it: tasks at decode
// are short, and their first chunk would otherwise wait on memory row by row.
template <typename C>
void prefetch_first_keys(const Task& task, const C* key_cache, const int64_t* block_table, int64_t q_len,
                         int64_t seq_len, const Shape& s) {
  const int64_t pos = seq_len - q_len + task.first_query;
  const int64_t lo = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
  // about 32 rows' worth of bytes: the first chunk of a one-head task
  const int64_t n = std::min(seq_len, lo + std::max<int64_t>(4, kKvChunk / task.kv_heads)) - lo;
  int64_t offsets[kKvChunk];
  const C* rows[kKvChunk];
  row_offsets(block_table, lo, n, s.block_size, s.num_kv_heads * s.head_dim, offsets);
  for (int64_t t = 0; t < n; ++t) rows[t] = key_cache + offsets[t] + task.kv_head * s.head_dim;
  prefetch_rows(rows, n, s.head_dim * task.kv_heads);
}

// T: the dtype of q and out; C: the cache's (T, or an fp8 format, whose scales the caller folded into s).
template <typename T, typename C>
void attend(const Task& task, const T* q, const C* key_cache, const C* value_cache, const int64_t* block_table,
            int64_t query_start, int64_t q_len, int64_t seq_len, const Shape& s, T* out, Work& work) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim;
  bool tiles = false;
#ifdef PAGODA_ATTN_BF16_DOT
  tiles = is_bf16<T>() && D % 32 == 0 && task.kv_heads == 1 &&
          std::min(kQueryTile, q_len - task.first_query) * group >= kMinTileRows;
#endif
  Rows rows;
  float* qf = nullptr;
  const auto [lo, hi] = setup_rows(rows, task, q, query_start, q_len, seq_len, s, work, tiles, qf);
  const int64_t token_stride = s.num_kv_heads * D, head_offset = task.kv_head * D;
  const C* k_rows[kKvChunk];
  const C* v_rows[kKvChunk];
  const C* next_k[kKvChunk];
  int64_t offsets[2 * kKvChunk];  // this chunk's rows, then the next chunk's
  for (int64_t c0 = lo; c0 < hi; c0 += kKvChunk) {
    const int64_t n = std::min(kKvChunk, hi - c0), n_next = std::clamp<int64_t>(hi - c0 - kKvChunk, 0, kKvChunk);
    row_offsets(block_table, c0, n + n_next, s.block_size, token_stride, offsets);
    for (int64_t t = 0; t < n; ++t) {
      k_rows[t] = key_cache + offsets[t] + head_offset;
      v_rows[t] = value_cache + offsets[t] + head_offset;
    }
    for (int64_t t = 0; t < n_next; ++t) next_k[t] = key_cache + offsets[n + t] + head_offset;
    // One head's rows sit 2 KB and more apart in blocks placed anywhere in the pool: too scattered for
    // the hardware prefetcher, so V rows are fetched while scores run and the next K rows during the V sums.
    if (task.kv_heads == 1) prefetch_rows(v_rows, n, D);
#ifdef PAGODA_ATTN_BF16_DOT
    if constexpr (is_bf16<T>()) {  // C: bf16 or fp8, widened to bf16 as the tiles are built
      if (tiles) {
        uint32_t* kt = work.words.data();
        uint32_t* vp = kt + (D / 2) * kKvChunk;
        transpose_keys(k_rows, n, D, kt);
        scores_bf16(rows, work.q_rows.data(), kt, c0, s.scale);
        prefetch_rows(next_k, n_next, D);
        pair_values(v_rows, n, D, vp);
        values_bf16(rows, vp, n);
        continue;
      }
    }
#endif
    if (D == 128) {  // the common head size (Llama, Qwen, Mistral): its vectors fit in registers
      scores_f32<C, 8>(rows, qf, k_rows, c0, n);
    } else {
      scores_f32(rows, qf, k_rows, c0, n);
    }
    for (int64_t r = 0; r < rows.count; ++r) softmax_chunk(rows, r);
    if (task.kv_heads == 1) prefetch_rows(next_k, n_next, D);
    if (D == 128) {
      values_f32<C, 8>(rows, v_rows, n);
    } else {
      values_f32(rows, v_rows, n);
    }
  }
  finish_rows(rows, task, query_start, s, tiles, out);
}
#endif

}  // namespace pagoda_attention
