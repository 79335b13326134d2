"""The Triton attention backend and CUDA graphs agree with the torch backend.

On CPU the Triton kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
the backend is compared with the torch one on small fp32 tensors and on the built-in stories260K model.
The ``gpu`` tests run the engine on CUDA: Triton with CUDA graphs, Triton eagerly, and torch attention
must produce the same greedy tokens.
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from attention_helpers import random_paged_step

from pagoda import LLM, SamplingParams
from pagoda.attention.choice import resolve_attention_backend
from pagoda.attention.protocol import AttentionLayerSpec, build_metadata
from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.attention.triton_backend import TritonAttentionBackend
from pagoda.cli import build_parser, engine_args_from
from pagoda.config import EngineArgs, builtin_model_path
from pagoda.worker.cuda_graphs import DecodeCudaGraphs, capture_sizes

# Compiled kernels need CUDA tensors; without a GPU the interpreter runs them on CPU tensors.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def random_step(query_lens: list[int], seq_lens: list[int], seed: int = 0):
    """A step over shuffled, non-contiguous blocks of a random cache; returns (q, k, v, kv_cache, tables)."""
    *tensors, tables = random_paged_step(query_lens, seq_lens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, 5, seed)
    return (*(t.to(DEVICE) for t in tensors), tables)


def run_both(query_lens: list[int], seq_lens: list[int], sliding_window):
    spec = AttentionLayerSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, sliding_window)
    q, k, v, kv_cache, tables = random_step(query_lens, seq_lens)
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        meta = build_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        meta.block_tables, meta.slot_mapping = meta.block_tables.to(DEVICE), meta.slot_mapping.to(DEVICE)
        cache = kv_cache.clone()
        backend.prepare(meta)
        out = backend.forward(q, k, v, cache, meta, spec)
        results.append((out, cache, meta))
    return results


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_triton_backend_matches_torch_on_a_mixed_step(sliding_window):
    # A prefill chunk on a cached prefix of 13 tokens, two decodes, and a fresh 5-token prompt.
    query_lens, seq_lens = [6, 1, 5, 1], [19, 11, 5, 23]
    (ref, ref_cache, _), (out, cache, meta) = run_both(query_lens, seq_lens, sliding_window)
    assert not meta.backend_state["decode"]  # the mixed step goes through the extend kernel
    assert torch.equal(cache, ref_cache)  # this step's K/V landed in the same slots
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_triton_backend_matches_torch_on_a_pure_decode_step(sliding_window):
    query_lens, seq_lens = [1, 1, 1], [17, 3, 9]
    (ref, ref_cache, _), (out, cache, meta) = run_both(query_lens, seq_lens, sliding_window)
    assert meta.backend_state["decode"]  # pure decode goes through the decode kernel
    assert meta.backend_state["block_tables"].dtype == torch.int32
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ---- the engine on stories260K --------------------------------------------------------------

SHARED = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
ENDINGS = [" One day, she saw", " Her mom said", " Tim and Sue"]
# No shared prefix, and long enough to prefill in several chunks while the others already decode.
OTHER = "Tom had a big red ball. He liked to throw it high in the sky and catch it with his hands every day."


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run_engine(attention_backend: str) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        attention_backend=attention_backend,
        max_model_len=64,
        block_size=8,
        max_num_batched_tokens=16,  # the prompts (~25 tokens) prefill in chunks, next to decodes
        enable_prefix_caching=True,
    )
    first = greedy(llm, [SHARED + ENDINGS[0]], 6)  # fills the cache with the shared prefix
    rest = greedy(llm, [SHARED + e for e in ENDINGS] + [OTHER], 6)  # prefix-cache hits, chunks next to decodes
    return first + rest, llm


@pytest.mark.slow
def test_engine_with_triton_attention_gives_the_torch_greedy_tokens(monkeypatch):
    kinds = set()  # the kinds of steps the Triton backend saw
    prepare = TritonAttentionBackend.prepare

    def recording_prepare(self, meta):
        prepare(self, meta)
        query_lens = {meta.query_len(i) for i in range(meta.num_reqs)}
        kinds.add("decode" if meta.backend_state["decode"] else "mixed" if 1 in query_lens else "prefill")

    monkeypatch.setattr(TritonAttentionBackend, "prepare", recording_prepare)
    expected, _ = run_engine("torch")
    tokens, llm = run_engine("triton")
    assert kinds == {"decode", "mixed", "prefill"}
    assert llm.engine.executor.driver_worker.model_runner.attn_backend.name == "triton"
    assert tokens == expected
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_chunked_prefill_steps > 0
    assert llm.engine.executor.driver_worker.model_runner.cuda_graphs is None  # graphs are for CUDA only


class EagerReplayGraphs(DecodeCudaGraphs):
    """Decode graphs whose "replay" reruns the forward on the static buffers: checks the buffer handling
    (padding rows, padded block tables, fixed context splits) without a GPU to capture on."""

    def _capture_one(self, size, meta, pool):
        out = self._forward(size, meta)
        graph = SimpleNamespace(replay=lambda: out.copy_(self._forward(size, meta)), pool=lambda: None)
        return graph, out


@pytest.mark.slow
def test_decode_graph_buffers_give_the_eager_tokens_for_padded_batches():
    prompts = [SHARED + e for e in ENDINGS] + [OTHER]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (3, 5, 7, 9)]
    expected = [o.outputs[0].token_ids for o in LLM(max_model_len=64).generate(prompts, params, use_tqdm=False)]
    llm = LLM(attention_backend="triton", max_model_len=64, block_size=8)
    runner = llm.engine.executor.driver_worker.model_runner
    runner.cuda_graphs = EagerReplayGraphs(runner.model, runner.kv_caches, max_num_seqs=4, max_model_len=64)
    runner.cuda_graphs.capture()
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == expected
    # Decode batches shrink 4 -> 3 -> 2 -> 1 as requests finish; the batch of 3 runs padded to 4, its
    # padding row holding the stale inputs of a finished request (which must be neither written nor read).
    assert set(runner.cuda_graphs.num_replays) == {4, 2, 1}


# ---- configuration ---------------------------------------------------------------------------


def test_unknown_attention_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend must be auto, torch or triton"):
        EngineArgs(attention_backend="flash").validate()


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(attention_backend="triton", device="cpu")


def test_auto_and_torch_resolve_to_torch_on_cpu(monkeypatch):
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("torch", torch.device("cpu")) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what the test suite sets on a machine without a GPU
    assert resolve_attention_backend("triton", torch.device("cpu")) == "triton"


def test_cli_flags_reach_the_engine_args():
    ns = build_parser().parse_args(["generate", "--attention-backend", "triton", "--enforce-eager"])
    args = engine_args_from(ns)
    assert (args.attention_backend, args.enforce_eager) == ("triton", True)
    defaults = engine_args_from(build_parser().parse_args(["generate"]))
    assert (defaults.attention_backend, defaults.enforce_eager) == ("auto", False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--attention-backend", "flash"])


def test_capture_sizes_follow_vllm_and_cover_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[4:], sizes[5:]))
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.slow
def test_cpu_engine_never_imports_triton():
    code = (
        "import sys; from pagoda import LLM, SamplingParams; "
        "llm = LLM(max_model_len=32); llm.generate(['Once'], SamplingParams(max_tokens=2), use_tqdm=False); "
        "assert 'triton' not in sys.modules, 'triton was imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr


# ---- CUDA ------------------------------------------------------------------------------------


def tiny_prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in torch.randint(5, 60, (num,), generator=gen)
    ]


def cuda_llm(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), tokenizer=str(builtin_model_path()), device="cuda", max_model_len=256, **kwargs)


def greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("arch, overrides", [("qwen3", {}), ("mistral", {"sliding_window": 16})])
def test_cuda_graphs_eager_triton_and_torch_agree(tiny, arch, overrides):
    model_dir = tiny.get(arch, torch.float32, **overrides)
    prompts, max_tokens = tiny_prompts(6), [24] * 6
    graphs = cuda_llm(model_dir, max_num_seqs=16)
    assert graphs.engine.executor.driver_worker.model_runner.cuda_graphs is not None
    with_graphs = greedy_ids(graphs, prompts, max_tokens)
    assert sum(graphs.engine.executor.driver_worker.model_runner.cuda_graphs.num_replays.values()) > 0
    eager = cuda_llm(model_dir, max_num_seqs=16, enforce_eager=True)
    assert eager.engine.executor.driver_worker.model_runner.cuda_graphs is None
    torch_attn = cuda_llm(model_dir, max_num_seqs=16, attention_backend="torch")
    assert torch_attn.engine.executor.driver_worker.model_runner.cuda_graphs is None
    assert with_graphs == greedy_ids(eager, prompts, max_tokens) == greedy_ids(torch_attn, prompts, max_tokens)


@pytest.mark.gpu
def test_graph_replay_pads_batches_between_captured_sizes(tiny):
    model_dir = tiny.get("qwen3", torch.float32)
    # Requests finish one after another, so decode batches shrink 5 -> 4 -> 3 -> 2 -> 1.
    prompts, max_tokens = tiny_prompts(5, seed=1), [6, 10, 14, 18, 22]
    graphs = cuda_llm(model_dir, max_num_seqs=16)
    assert graphs.engine.executor.driver_worker.model_runner.cuda_graphs.sizes == [1, 2, 4, 8, 16]
    tokens = greedy_ids(graphs, prompts, max_tokens)
    replays = graphs.engine.executor.driver_worker.model_runner.cuda_graphs.num_replays
    assert replays[8] > 0 and replays[4] > 0  # batches of 5 and 3 ran padded
    assert set(replays) <= {1, 2, 4, 8}
    eager = cuda_llm(model_dir, max_num_seqs=16, enforce_eager=True)
    assert tokens == greedy_ids(eager, prompts, max_tokens)
