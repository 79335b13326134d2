// Causal attention over the paged KV cache for a flattened varlen batch, reading K/V blocks in place.
//
// Gathering each request's context into a contiguous copy and calling SDPA read and wrote every
// cached K/V byte twice per layer, and SDPA's CPU kernel is slow for single-token queries. Here one
// task is (request, KV head, tile of up to kQueryTile query tokens): the query heads that share the KV
// head (GQA) and the tile's tokens form the task's rows, so every K/V row is read once per task and
// used by all its rows. A task's work is attend (paged_attention_task.h), its stages (scores, online softmax, V sums)
// are in paged_attention_stages.h; this file builds the tasks, runs them across threads, writes this step's K/V
// rows into the caches and registers the op.
//
// Each query token at position p (its request has seq_len tokens after this step, the last q_len of
// them are this step's queries) attends to positions [max(0, p - window + 1), p].
//
// fp8 caches: this step's K/V rows are quantized as they are written (K / k_scale, V / v_scale), and read back
// exactly widened by the stages; any q dtype reads them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "paged_attention_task.h"

namespace {

using namespace pagoda_attention;

// Whether this build (compiled for this machine) has the kernel, which paged_attention_supported() reports: without
// AVX-512 the op only raises.
#ifdef PAGODA_ATTN_AVX512
constexpr bool kAttentionKernel = true;
#else
constexpr bool kAttentionKernel = false;
#endif

// Decode requests: tasks of a group of KV heads, as many heads as still leaves ~4 tasks per thread.
// Prefill chunks: one task per KV head and tile of kQueryTile query tokens, a head's last (longest) tile first.
// Also checks that every block a request reads indexes the cache (a plain loop over the used entries: two ATen
// reductions over the whole table cost more than that on every layer).
std::vector<Task> build_tasks(const int64_t* start_p, const int64_t* len_p, const int64_t* tables, int64_t num_reqs,
                              int64_t num_blocks, const Shape& s) {
  const int64_t wanted = 4 * at::get_num_threads();
  const int64_t head_groups =
      std::clamp<int64_t>((wanted + num_reqs - 1) / std::max<int64_t>(num_reqs, 1), 1, s.num_kv_heads);
  const int64_t decode_heads = (s.num_kv_heads + head_groups - 1) / head_groups;
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = start_p[i + 1] - start_p[i];
    TORCH_CHECK(q_len >= 0 && q_len <= len_p[i] && len_p[i] <= s.max_blocks * s.block_size, "bad lengths");
    for (int64_t b = 0; b * s.block_size < len_p[i]; ++b) {
      const int64_t block = tables[i * s.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block table entries must index the cache's ", num_blocks, " blocks");
    }
    if (q_len == 1) {
      for (int64_t h = 0; h < s.num_kv_heads; h += decode_heads)
        tasks.push_back({i, h, std::min(decode_heads, s.num_kv_heads - h), 0});
      continue;
    }
    if (q_len == 0) continue;
    // later tiles see more context: longest first, so the tasks left for the end of a call are short
    const int64_t last_tile = (q_len - 1) / kQueryTile * kQueryTile;
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      for (int64_t first = last_tile; first >= 0; first -= kQueryTile) tasks.push_back({i, h, 1, first});
  }
  return tasks;
}

bool is_fp8_type(at::ScalarType type) { return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2; }

// cache rows [slot] = rows [token] for this step's K or V: one dispatch for both caches instead of two
// index_copy_ calls per layer. rows may be a per-head view of the fused qkv output (token stride > width).
// An fp8 cache stores rows / scale, saturated and rounded to nearest (quantize16).
void write_cache(at::Tensor& cache, const at::Tensor& rows, const int64_t* slots, int64_t num_tokens, double scale) {
  const bool fp8 = is_fp8_type(cache.scalar_type());
  TORCH_CHECK(rows.dim() == 3 && rows.size(0) == num_tokens && rows.size(1) == cache.size(2) &&
                  rows.size(2) == cache.size(3) && (fp8 || rows.scalar_type() == cache.scalar_type()),
              "key/value must be [tokens, kv_heads, head_dim] in the cache's dtype");
  const int64_t width = cache.size(2) * cache.size(3);
  const at::Tensor src = rows.stride(2) == 1 && rows.stride(1) == rows.size(2) ? rows : rows.contiguous();
  const int64_t stride = src.stride(0), bytes = width * cache.element_size();
  if (fp8) {
#ifdef PAGODA_ATTN_AVX512
    uint8_t* to = static_cast<uint8_t*>(cache.data_ptr());
    auto run = [&](auto row_tag, auto cache_tag) {
      using T = decltype(row_tag);
      quantize_rows<T, decltype(cache_tag)>(src.data_ptr<T>(), stride, to, width, slots, num_tokens, scale);
    };
    auto with_rows = [&](auto cache_tag) {
      const auto type = src.scalar_type();
      TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, "fp8 caches take 16/32-bit rows");
      if (type == at::kBFloat16) run(at::BFloat16(), cache_tag);
      else if (type == at::kHalf) run(at::Half(), cache_tag);
      else run(0.0f, cache_tag);
    };
    if (cache.scalar_type() == at::kFloat8_e4m3fn) with_rows(at::Float8_e4m3fn());
    else with_rows(at::Float8_e5m2());
#endif
    return;
  }
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(cache.data_ptr());
  at::parallel_for(0, num_tokens, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) std::memcpy(to + slots[t] * bytes, from + t * stride * cache.element_size(), bytes);
  });
}

void write_caches(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t num_tokens = slots.numel(), num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot_mapping entries must index the cache's ", num_slots, " slots");
  write_cache(key_cache, key, sp, num_tokens, k_scale);
  write_cache(value_cache, value, sp, num_tokens, v_scale);
}

#ifdef PAGODA_ATTN_AVX512
// Runs every task: T is q's dtype, C the caches'. An fp8 cache's scales (times the widening's factor, see
// kFp8ReadFactor) fold into the softmax scale (K) and the output normalisation (V).
template <typename T, typename C>
void run_tasks(const std::vector<Task>& tasks, const at::Tensor& q, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const int64_t* tp, const int64_t* start_p, const int64_t* len_p,
               Shape s, double k_scale, double v_scale, at::Tensor& out) {
  if constexpr (is_fp8<C>()) {
    s.scale *= static_cast<float>(k_scale) * kFp8ReadFactor<C>;
    s.v_factor = static_cast<float>(v_scale) * kFp8ReadFactor<C>;
  }
  const T* qp = q.data_ptr<T>();
  const C* kp = key_cache.data_ptr<C>();
  const C* vp = value_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  // Threads claim tasks one at a time instead of splitting the list in two: with a static split one thread
  // waited for the other at the end of every call (3-5% of prefill attention in gomp's barrier). Each thread
  // claims its next task before running the current one, so that task's first K rows load meanwhile.
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    Work work;
    for (int64_t i = next.fetch_add(1); i < num_tasks;) {
      const int64_t following = next.fetch_add(1);
      if (following < num_tasks) {
        const int64_t rn = tasks[following].req;
        prefetch_first_keys(tasks[following], kp, tp + rn * s.max_blocks, start_p[rn + 1] - start_p[rn], len_p[rn], s);
      }
      const Task& task = tasks[i];
      const int64_t r = task.req;
      attend<T, C>(task, qp, kp, vp, tp + r * s.max_blocks, start_p[r], start_p[r + 1] - start_p[r], len_p[r], s, op,
                   work);
      i = following;
    }
  });
}
#endif

at::Tensor paged_attention(const at::Tensor& q, at::Tensor& key_cache, at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                           const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value,
                           const std::optional<at::Tensor>& slot_mapping, double k_scale, double v_scale) {
#ifdef PAGODA_ATTN_AVX512
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q [tokens, heads, dim], caches [blocks, block, kv_heads, dim]");
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK((q.scalar_type() == cache_type || is_fp8_type(cache_type)) && cache_type == value_cache.scalar_type(),
              "q and the caches must share a dtype (or the caches be fp8)");
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "k_scale and v_scale must be positive");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  Shape s{q.size(1), key_cache.size(2), q.size(2), key_cache.size(1), block_tables.size(1),
          static_cast<float>(scale), sliding_window};
  TORCH_CHECK(s.head_dim % 16 == 0 && s.head_dim <= kMaxHeadDim, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && key_cache.size(3) == s.head_dim, "head shapes disagree");
  TORCH_CHECK(key.has_value() == value.has_value() && key.has_value() == slot_mapping.has_value(),
              "key, value and slot_mapping come together");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "paged_attention takes float32, bfloat16 or float16");
  if (slot_mapping.has_value()) write_caches(key_cache, value_cache, *key, *value, *slot_mapping, k_scale, v_scale);
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto starts = query_start_loc.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t num_reqs = lens.numel();
  TORCH_CHECK(starts.numel() == num_reqs + 1 && tables.size(0) == num_reqs, "one block table and length per request");
  const int64_t* start_p = starts.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  TORCH_CHECK(start_p[0] == 0 && start_p[num_reqs] == q.size(0), "query_start_loc must span q's tokens");
  const std::vector<Task> tasks = build_tasks(start_p, len_p, tables.data_ptr<int64_t>(), num_reqs, key_cache.size(0), s);
  auto out = at::empty_like(qc);
  auto run = [&](auto q_tag, auto cache_tag) {
    run_tasks<decltype(q_tag), decltype(cache_tag)>(tasks, qc, key_cache, value_cache, tables.data_ptr<int64_t>(),
                                                    start_p, len_p, s, k_scale, v_scale, out);
  };
  auto with_cache = [&](auto q_tag) {
    if (cache_type == at::kFloat8_e4m3fn) run(q_tag, at::Float8_e4m3fn());
    else if (cache_type == at::kFloat8_e5m2) run(q_tag, at::Float8_e5m2());
    else run(q_tag, q_tag);
  };
  if (q.scalar_type() == at::kBFloat16) with_cache(at::BFloat16());
  else if (q.scalar_type() == at::kHalf) with_cache(at::Half());
  else with_cache(0.0f);
  return out;
#else
  TORCH_CHECK(false, "paged_attention needs AVX-512, which this build lacks");
#endif
}

bool paged_attention_supported() { return kAttentionKernel; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  // With key, value and slot_mapping, this step's K/V rows are first written into the caches (hence a!, b!).
  // fp8 caches (float8_e4m3fn / float8_e5m2) store K / k_scale and V / v_scale; other caches ignore the scales.
  m.def(
      "paged_attention(Tensor q, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int sliding_window, Tensor? key=None, "
      "Tensor? value=None, Tensor? slot_mapping=None, float k_scale=1.0, float v_scale=1.0) -> Tensor");
  m.def("paged_attention_supported() -> bool", &paged_attention_supported);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
