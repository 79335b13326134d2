"""``kv_cache_dtype`` fp8_e4m3 / fp8_e5m2 through the whole engine on the CPU.

KV blocks hold 1-byte fp8 codes of K / k_scale and V / v_scale: the same memory holds twice the tokens of a
bf16 cache (four times those of a float32 one), greedy outputs stay close to the model-dtype cache's, and the
schedulers' modes (preemption, chunked prefill, prefix caching) give the same tokens as a plain run over the same
fp8 cache. stories260K (head_dim 8) attends through SDPA; the tiny Qwen3 (head_dim 16) in bfloat16 through the
native kernel. Run with ``-s`` to see the measured agreement.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.llama.modeling_llama as hf_llama
from test_models import random_prompt
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.attention.protocol import AttentionLayerSpec, build_metadata, quantize_kv
from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.attention.triton_backend import TritonAttentionBackend
from pagoda.config import builtin_model_path
from pagoda.layers.attention import Attention
from pagoda.worker.kv_sizing import KVCacheShape, cpu_num_blocks, kv_cache_torch_dtype

MAX_TOKENS = 24
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
STORY_OPENINGS = [
    "Once upon a time", "Tim and Sue went to the park", "Lily saw a big red ball", "The little dog was sad",
    "One day, a bird", "Mom said, \"Let's bake a cake", "Ben had a toy car", "There was a tiny frog",
]  # fmt: skip
# The spec per (model, cache format): fed the same prefix (teacher forcing), at least this share of the fp8 run's
# greedy tokens are the model-dtype cache's argmax, and none is more than this many nats below it.
MIN_AGREEMENT = {
    ("stories260K", "fp8_e4m3"): (0.85, 1.0),
    ("stories260K", "fp8_e5m2"): (0.8, 2.0),
    ("qwen3", "fp8_e4m3"): (0.8, 0.5),
    ("qwen3", "fp8_e5m2"): (0.7, 1.5),
}


@pytest.fixture(scope="module", autouse=True)
def native_kernels():
    """No start-up kernel timing: faster engines, and every engine of a comparison runs the same kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_CPU_KERNELS", "native")
        yield


@pytest.fixture(scope="module")
def models(tiny) -> dict[str, tuple[str, list[list[int]]]]:
    """name -> (model directory, prompts as token ids)."""
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path())
    stories = [tokenizer.encode(text) for text in STORY_OPENINGS]
    qwen3 = [random_prompt(length, seed) for seed, length in enumerate((5, 9, 17, 24, 33, 40, 12, 3))]
    return {"stories260K": (str(builtin_model_path()), stories), "qwen3": (str(tiny.get("qwen3")), qwen3)}


def make_llm(model_dir: str, dtype: str, kv_cache_dtype: str, **kwargs) -> LLM:
    # The tiny checkpoints carry no tokenizer; stories260K's covers their 256 ids.
    return LLM(
        model=model_dir,
        tokenizer=str(builtin_model_path()),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=256,
        **kwargs,
    )


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, float, list[int]]:
    """(prompts with identical tokens, mean common-prefix share, index of the first divergence per prompt)."""
    first = []
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        first.append(same)
    identical = sum(g == w for g, w in zip(got, want))
    return identical, sum(first) / (len(first) * MAX_TOKENS), first


@pytest.fixture(scope="module")
def auto_run(models):
    """auto_run(model, dtype): (the engine over the model-dtype cache, its greedy tokens), each built once."""
    runs: dict[tuple[str, str], tuple[LLM, list[list[int]]]] = {}

    def get(model: str, dtype: str) -> tuple[LLM, list[list[int]]]:
        if (model, dtype) not in runs:
            model_dir, prompts = models[model]
            llm = make_llm(model_dir, dtype, "auto")
            runs[model, dtype] = llm, greedy(llm, prompts)
        return runs[model, dtype]

    return get


def logprob_gaps(llm: LLM, prompts: list[list[int]], outputs: list[list[int]]) -> list[float]:
    """Fed prompt + output (teacher forcing), how far below ``llm``'s top logprob each output token is (0: it is
    the argmax). Free-running greedy texts part at the first near tie; this scores every token on its own."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    results = llm.generate([p + o for p, o in zip(prompts, outputs)], params, use_tqdm=False)
    gaps = []
    for prompt, output, result in zip(prompts, outputs, results):
        for token, entry in zip(output, result.prompt_logprobs[len(prompt) :]):
            gaps.append(max(lp.logprob for lp in entry.values()) - entry[token].logprob)
    return gaps


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["stories260K", "qwen3"])
def test_fp8_cache_greedy_tokens_agree_with_the_model_dtype_cache(models, auto_run, model, dtype, kv_cache_dtype):
    model_dir, prompts = models[model]
    llm = make_llm(model_dir, dtype, kv_cache_dtype)
    caches = llm.engine.executor.driver_worker.model_runner.kv_caches
    assert caches and all(c.dtype == FP8[kv_cache_dtype] and c.element_size() == 1 for c in caches)
    got = greedy(llm, prompts)
    auto_llm, want = auto_run(model, dtype)
    identical, prefix_share, first = agreement(got, want)
    gaps = logprob_gaps(auto_llm, prompts, got)
    argmax_share = sum(g == 0 for g in gaps) / len(gaps)
    print(
        f"\n{model} {dtype} {kv_cache_dtype} vs auto cache: {identical}/{len(prompts)} prompts identical for "
        f"{MAX_TOKENS} tokens (mean common prefix {prefix_share:.0%}, first divergence at {first}); "
        f"fed the same prefix, {argmax_share:.1%} of the fp8 tokens are the auto cache's argmax, the worst "
        f"{max(gaps):.3f} nats below it"
    )
    min_argmax, max_gap = MIN_AGREEMENT[model, kv_cache_dtype]
    assert argmax_share >= min_argmax and max(gaps) <= max_gap


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_stories260k_equals_transformers_with_its_keys_and_values_rounded_through_fp8(
    models, kv_cache_dtype, monkeypatch
):
    # The specification end to end: transformers' float32 model whose post-rotary keys and values are rounded to
    # fp8 and back, as the cache stores them. Prompt logprobs check the prefill, greedy tokens the decode steps.
    fp8 = FP8[kv_cache_dtype]

    def through_fp8(x: torch.Tensor) -> torch.Tensor:
        return quantize_kv(x, 1.0, fp8).to(x.dtype)

    rotary = hf_llama.apply_rotary_pos_emb

    def rotary_then_fp8(q, k, *args, **kwargs):
        q, k = rotary(q, k, *args, **kwargs)
        return q, through_fp8(k)

    monkeypatch.setattr(hf_llama, "apply_rotary_pos_emb", rotary_then_fp8)
    model = AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.float32)
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda module, args, out: through_fp8(out))
    model_dir, prompts = models["stories260K"]
    prompts = prompts[:4]
    llm = make_llm(model_dir, "float32", kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    for prompt, result in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :]
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
        assert result.outputs[0].token_ids == expected.tolist()
        ours = torch.tensor([entry[token].logprob for token, entry in zip(prompt[1:], result.prompt_logprobs[1:])])
        torch.testing.assert_close(ours, logprobs[torch.arange(len(prompt) - 1), prompt[1:]], atol=1e-4, rtol=0)


def test_kv_cache_shape_of_fp8_is_one_byte_per_element():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int8", torch.bfloat16)
    shapes = {dtype: KVCacheShape(5, 4, 8, 16, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)}
    assert shapes[torch.float8_e4m3fn].bytes_per_block == 2 * 5 * 16 * 4 * 8  # K and V, layers, tokens, heads, dims
    assert shapes[torch.bfloat16].bytes_per_block == 2 * shapes[torch.float8_e4m3fn].bytes_per_block
    assert shapes[torch.float32].bytes_per_block == 4 * shapes[torch.float8_e4m3fn].bytes_per_block
    budget = 100 * shapes[torch.float32].bytes_per_block
    blocks = {dtype: cpu_num_blocks(shape, budget, 8, 256) for dtype, shape in shapes.items()}
    assert blocks == {torch.float32: 100, torch.bfloat16: 200, torch.float8_e4m3fn: 400}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_same_kv_cache_memory_holds_twice_the_tokens_of_a_bf16_cache(kv_cache_dtype):
    model_dir = str(builtin_model_path())
    budget = 48 * 2 * 5 * 16 * 4 * 8 * 2  # 48 bf16 blocks of 16 tokens (5 layers, 4 KV heads of 8 dims)
    bf16 = make_llm(model_dir, "bfloat16", "auto", kv_cache_memory=budget)
    fp8 = make_llm(model_dir, "bfloat16", kv_cache_dtype, kv_cache_memory=budget)
    bf16_stats, fp8_stats = bf16.engine.get_stats(), fp8.engine.get_stats()
    assert (bf16_stats.num_blocks, fp8_stats.num_blocks) == (48, 96)
    assert (
        fp8.engine.executor.driver_worker.model_runner.kv_shape.bytes_per_block * 2
        == bf16.engine.executor.driver_worker.model_runner.kv_shape.bytes_per_block
    )
    assert fp8.engine.executor.driver_worker.model_runner.kv_shape.dtype == FP8[kv_cache_dtype]
    cache_bytes = [
        sum(c.nbytes for c in llm.engine.executor.driver_worker.model_runner.kv_caches) for llm in (bf16, fp8)
    ]
    assert cache_bytes[0] == cache_bytes[1] == budget


@pytest.mark.parametrize("model, dtype", [("stories260K", "float32"), ("qwen3", "bfloat16")])
def test_preemption_chunked_prefill_and_prefix_caching_give_the_plain_runs_tokens(models, model, dtype):
    model_dir, prompts = models[model]
    prompts = [prompts[0] * 4 + p for p in prompts[:6]]  # a shared prefix of whole blocks for the prefix cache
    plain_llm = make_llm(model_dir, dtype, "fp8_e4m3", enable_prefix_caching=False)
    plain = greedy(plain_llm, prompts)
    block_bytes = plain_llm.engine.executor.driver_worker.model_runner.kv_shape.bytes_per_block
    llm = make_llm(
        model_dir,
        dtype,
        "fp8_e4m3",
        enable_prefix_caching=True,
        kv_cache_memory=16 * block_bytes,  # one max_model_len sequence; the batch needs more
        max_num_batched_tokens=32,
    )
    stats = llm.engine.get_stats()
    assert stats.num_blocks == 16  # the fp8 blocks are what the scheduler counts
    assert greedy(llm, prompts) == plain
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.num_chunked_prefill_steps > 0


def test_kv_scales_are_used_when_writing_and_reading(models, auto_run):
    # Scales far from 1 change every stored code; a reader that ignored them would read values 20-50x off.
    model_dir, prompts = models["stories260K"]
    llm = make_llm(model_dir, "float32", "fp8_e4m3")
    unscaled = make_llm(model_dir, "float32", "fp8_e4m3")
    for layer in llm.engine.executor.driver_worker.model_runner.model.model.layers:
        layer.self_attn.attn.set_kv_scales(0.05, 0.02)
    got = greedy(llm, prompts)
    greedy(unscaled, prompts)  # the same steps and blocks: only the scales differ
    codes = [e.engine.executor.driver_worker.model_runner.kv_caches[0].view(torch.uint8) for e in (llm, unscaled)]
    assert codes[0].any() and not torch.equal(codes[0], codes[1])
    auto_llm, want = auto_run("stories260K", "float32")
    gaps = logprob_gaps(auto_llm, prompts, got)
    argmax_share = sum(g == 0 for g in gaps) / len(gaps)
    print(f"\nk_scale 0.05, v_scale 0.02: {argmax_share:.1%} argmax, the worst {max(gaps):.3f} nats below it")
    min_argmax, max_gap = MIN_AGREEMENT["stories260K", "fp8_e4m3"]
    assert argmax_share >= min_argmax and max(gaps) <= max_gap


def test_set_kv_scales_updates_the_layer_spec_and_rejects_bad_scales():
    attn = Attention(4, 2, 16, backend=None)
    assert (attn.k_scale, attn.v_scale, attn.spec.k_scale, attn.spec.v_scale) == (1.0, 1.0, 1.0, 1.0)
    attn.set_kv_scales(torch.tensor(0.5), 2.0)  # a checkpoint's scalar tensor is fine
    assert (attn.k_scale, attn.v_scale, attn.spec.k_scale, attn.spec.v_scale) == (0.5, 2.0, 0.5, 2.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale"):
            attn.set_kv_scales(bad, 1.0)


# ---- the Triton backend (Triton's interpreter on CPU) and CUDA --------------------------------------------------
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("query_lens, seq_lens", [([6, 1, 5, 1], [19, 11, 5, 23]), ([1, 1, 1], [17, 3, 9])])
def test_triton_backend_writes_and_reads_fp8_caches_like_the_torch_backend(fp8, query_lens, seq_lens):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, k_scale=0.02, v_scale=0.5)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    q, k, v = (
        torch.randn(sum(query_lens), h, head_dim, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    k[0, 0, :4] = torch.tensor([100.0, -100.0, 1e-5, 3e-3])  # saturating and subnormal codes
    cached = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = torch.stack([quantize_kv(cached[0], spec.k_scale, fp8), quantize_kv(cached[1], spec.v_scale, fp8)])
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        meta = build_metadata(query_lens, seq_lens, tables, block_size)
        meta.block_tables, meta.slot_mapping = meta.block_tables.to(DEVICE), meta.slot_mapping.to(DEVICE)
        cache = kv_cache.to(DEVICE)
        backend.prepare(meta)
        results.append((backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache, meta, spec), cache))
    (want, want_cache), (got, got_cache) = results
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))  # the same codes in the same slots
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_gpu_cuda_graphs_eager_triton_and_torch_agree_over_an_fp8_cache(tiny, kv_cache_dtype):
    model_dir = str(tiny.get("qwen3", torch.float32))
    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 17, 40, 9, 28, 60))]
    runs = {}
    for name, kwargs in {
        "graphs": {},
        "eager": {"enforce_eager": True},
        "torch": {"attention_backend": "torch"},
    }.items():
        llm = make_llm(model_dir, "float32", kv_cache_dtype, device="cuda", max_num_seqs=16, **kwargs)
        assert all(c.dtype == FP8[kv_cache_dtype] for c in llm.engine.executor.driver_worker.model_runner.kv_caches)
        assert (llm.engine.executor.driver_worker.model_runner.cuda_graphs is not None) == (name == "graphs")
        runs[name] = greedy(llm, prompts)
        if name == "graphs":
            assert sum(llm.engine.executor.driver_worker.model_runner.cuda_graphs.num_replays.values()) > 0
    assert runs["graphs"] == runs["eager"] == runs["torch"]
