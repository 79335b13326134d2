// Causal attention over the paged KV cache for a flattened varlen batch, reading K/V blocks in place.
//
// Gathering each request's context into a contiguous copy and calling SDPA read and wrote every
// cached K/V byte twice per layer, and SDPA's CPU kernel is slow for single-token queries: at 32
// decodes of ~160 tokens that was ~4 ms per layer, more than the layer's GEMMs. Here one task is
// (request, KV head, tile of up to kQueryTile query tokens): the query heads that share the KV head
// (GQA) and the tile's tokens form the task's rows, so every K/V row is read and widened to float32
// once per task and used by all its rows. Scores, softmax and the output sum are float32, with an
// online (streaming) softmax over chunks of kKvChunk context tokens.
//
// Each query token at position p (its request has seq_len tokens after this step, the last q_len of
// them are this step's queries) attends to positions [max(0, p - window + 1), p].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGODA_ATTN_AVX512 1
#endif

namespace {

constexpr int64_t kQueryTile = 8;  // query tokens per task (prefill chunks); decode tasks have one
constexpr int64_t kKvChunk = 32;   // context tokens per online-softmax step
constexpr int64_t kMaxHeadDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#ifdef PAGODA_ATTN_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0 (scores minus their running max): 2^n * 2^f with |f| <= 1/2 and a degree-7 Taylor
// polynomial for 2^f (relative error < 1e-8 before float32 rounding); x below -100 gives 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Task {
  int64_t req, kv_head, first_query;  // first_query: index within the request's queries
};

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
  int64_t window;  // 0: unlimited
};

// One task: rows r = token * group + g for tokens [first_query, first_query + tokens).
template <typename T>
void attend(const Task& task, const T* q, const T* key_cache, const T* value_cache, const int64_t* block_table,
            int64_t query_start, int64_t q_len, int64_t seq_len, const Shape& s, T* out, std::vector<float>& work) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim, vecs = D / 16;
  const int64_t tokens = std::min(kQueryTile, q_len - task.first_query), rows = tokens * group;
  // work: q [rows][D], acc [rows][D], scores [rows][kKvChunk], m, l, first, last [rows]
  work.resize(rows * (2 * D + kKvChunk + 4));
  float* qf = work.data();
  float* acc = qf + rows * D;
  float* scores = acc + rows * D;
  float* m = scores + rows * kKvChunk;
  float* l = m + rows;
  float* first = l + rows;  // as float: positions stay far below 2^24
  float* last = first + rows;
  int64_t lo = seq_len, hi = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = task.first_query + r / group, head = task.kv_head * group + r % group;
    const T* qr = q + ((query_start + token) * s.num_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qr[d]) * s.scale;
    const int64_t pos = seq_len - q_len + token;
    const int64_t begin = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
    first[r] = static_cast<float>(begin);
    last[r] = static_cast<float>(pos);
    lo = std::min(lo, begin);
    hi = std::max(hi, pos + 1);
    m[r] = kNegInf;
    l[r] = 0.0f;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
  }
  const int64_t token_stride = s.num_kv_heads * D, row_bytes = D * static_cast<int64_t>(sizeof(T));
  auto offset_of = [&](int64_t pos) {  // element offset of this head's row at position pos
    return (block_table[pos / s.block_size] * s.block_size + pos % s.block_size) * token_stride + task.kv_head * D;
  };
  // Rows of one head sit 2 KB and more apart in blocks placed anywhere in the pool: too scattered for the
  // hardware prefetcher, so a chunk's V rows and the next chunk's K rows are prefetched while scores run.
  auto prefetch_row = [&](const T* row) {
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
  };
  int64_t offsets[kKvChunk], next_offsets[kKvChunk];
  for (int64_t t = 0; t < std::min(kKvChunk, hi - lo); ++t) next_offsets[t] = offset_of(lo + t);
  for (int64_t c0 = lo; c0 < hi; c0 += kKvChunk) {
    const int64_t n = std::min(kKvChunk, hi - c0);
    const int64_t n_next = std::max<int64_t>(0, std::min(kKvChunk, hi - c0 - kKvChunk));
    std::copy(next_offsets, next_offsets + n, offsets);
    for (int64_t t = 0; t < n_next; ++t) next_offsets[t] = offset_of(c0 + kKvChunk + t);
    for (int64_t t = 0; t < n; ++t) {  // scores[r][t] = q_r . k_(c0+t)
      const T* kr = key_cache + offsets[t];
      prefetch_row(value_cache + offsets[t]);
      if (t < n_next) prefetch_row(key_cache + next_offsets[t]);
      __m512 kv[kMaxHeadDim / 16];
      for (int64_t v = 0; v < vecs; ++v) kv[v] = load16(kr + v * 16);
      for (int64_t r = 0; r < rows; ++r) {
        const float pos = static_cast<float>(c0 + t);
        if (pos < first[r] || pos > last[r]) {
          scores[r * kKvChunk + t] = kNegInf;
          continue;
        }
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qf + r * D), kv[0]);
        for (int64_t v = 1; v < vecs; ++v) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + r * D + v * 16), kv[v], dot);
        scores[r * kKvChunk + t] = _mm512_reduce_add_ps(dot);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // online softmax: scores become probabilities
      float* sr = scores + r * kKvChunk;
      for (int64_t t = n; t < kKvChunk; ++t) sr[t] = kNegInf;
      const __m512 s0 = _mm512_loadu_ps(sr), s1 = _mm512_loadu_ps(sr + 16);
      const float chunk_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      if (chunk_max == kNegInf) {  // nothing visible to this row in the chunk
        std::fill(sr, sr + kKvChunk, 0.0f);
        continue;
      }
      const float m_new = std::max(m[r], chunk_max);
      const float correction = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
      const __m512 mv = _mm512_set1_ps(m_new);
      const __m512 inf = _mm512_set1_ps(kNegInf);  // masked tokens get exactly 0
      const __m512 p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, inf, _CMP_NEQ_OQ), exp_nonpositive(_mm512_sub_ps(s0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, inf, _CMP_NEQ_OQ), exp_nonpositive(_mm512_sub_ps(s1, mv)));
      _mm512_storeu_ps(sr, p0);
      _mm512_storeu_ps(sr + 16, p1);
      l[r] = l[r] * correction + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = m_new;
      if (correction != 1.0f) {
        const __m512 cv = _mm512_set1_ps(correction);
        for (int64_t v = 0; v < vecs; ++v)
          _mm512_storeu_ps(acc + r * D + v * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + v * 16), cv));
      }
    }
    for (int64_t t = 0; t < n; ++t) {  // acc_r += p_r[t] * v_(c0+t)
      const T* vr = value_cache + offsets[t];
      __m512 vv[kMaxHeadDim / 16];
      for (int64_t v = 0; v < vecs; ++v) vv[v] = load16(vr + v * 16);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * kKvChunk + t];
        if (p == 0.0f) continue;
        const __m512 pv = _mm512_set1_ps(p);
        for (int64_t v = 0; v < vecs; ++v)
          _mm512_storeu_ps(acc + r * D + v * 16, _mm512_fmadd_ps(pv, vv[v], _mm512_loadu_ps(acc + r * D + v * 16)));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = task.first_query + r / group, head = task.kv_head * group + r % group;
    T* orow = out + ((query_start + token) * s.num_heads + head) * D;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[r * D + d] * inv);
  }
}
#endif

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
#ifdef PAGODA_ATTN_AVX512
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q [tokens, heads, dim], caches [blocks, block, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  Shape s{q.size(1), key_cache.size(2), q.size(2), key_cache.size(1), block_tables.size(1),
          static_cast<float>(scale), sliding_window};
  TORCH_CHECK(s.head_dim % 16 == 0 && s.head_dim <= kMaxHeadDim, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && key_cache.size(3) == s.head_dim, "head shapes disagree");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto starts = query_start_loc.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t num_reqs = lens.numel();
  TORCH_CHECK(starts.numel() == num_reqs + 1 && tables.size(0) == num_reqs, "one block table and length per request");
  if (tables.numel() > 0) {
    TORCH_CHECK(tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < key_cache.size(0),
                "block table entries must index the cache's ", key_cache.size(0), " blocks");
  }
  const int64_t* start_p = starts.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = start_p[i + 1] - start_p[i];
    TORCH_CHECK(q_len >= 0 && q_len <= len_p[i] && len_p[i] <= s.max_blocks * s.block_size, "bad lengths");
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      for (int64_t first = 0; first < q_len; first += kQueryTile) tasks.push_back({i, h, first});
  }
  auto out = at::empty_like(qc);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "paged_attention takes float32, bfloat16 or float16");
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = key_cache.data_ptr<scalar_t>();
    const scalar_t* vp = value_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
      std::vector<float> work;
      for (int64_t i = b; i < e; ++i) {
        const Task& task = tasks[i];
        const int64_t r = task.req;
        attend<scalar_t>(task, qp, kp, vp, tp + r * s.max_blocks, start_p[r], start_p[r + 1] - start_p[r], len_p[r],
                         s, op, work);
      }
    });
  };
  if (q.scalar_type() == at::kBFloat16) run(at::BFloat16());
  else if (q.scalar_type() == at::kHalf) run(at::Half());
  else run(0.0f);
  return out;
#else
  TORCH_CHECK(false, "paged_attention needs AVX-512, which this build lacks");
#endif
}

bool paged_attention_supported() {
#ifdef PAGODA_ATTN_AVX512
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, float scale, int sliding_window) -> Tensor");
  m.def("paged_attention_supported() -> bool", &paged_attention_supported);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
