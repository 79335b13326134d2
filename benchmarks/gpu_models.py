"""The random-weight models of the GPU benchmarks and the engine's decode-step timing, shared by
benchmarks/gpu_check.py (end to end), gpu_tp.py (tensor parallel) and gpu_quant.py (``--engine-decode``).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from common import log  # noqa: E402 (the benchmarks folder is not a package)

# Llama-3-8B's dimensions; the weights are random.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3_ROPE |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA8B_SHAPE = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
LLAMA8B_SHAPE |= {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5}
LLAMA8B_SHAPE |= {"rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 8192, "tie_word_embeddings": False}
LLAMA8B_SHAPE |= {"attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
TINY_LLAMA_SHAPE = LLAMA8B_SHAPE | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
TINY_LLAMA_SHAPE |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_LLAMA_SHAPE |= {"max_position_embeddings": 512, "rope_parameters": dict(LLAMA3_ROPE)}  # a copy
TINY_LLAMA_SHAPE["rope_parameters"] |= {"original_max_position_embeddings": 256}


@dataclass(frozen=True, slots=True)
class E2ESpec:
    """One end-to-end model: how to get it, and what the run needs."""

    key: str
    label: str
    family: Optional[str]  # "Qwen3" or "Llama": built from ``shape``; None: the built-in stories260K
    shape: Optional[dict]
    dtype: torch.dtype
    need_s: float  # the whole model (build, transformers, Pagoda): skipped when less is left
    pagoda_need_s: float  # kept back from the transformers baseline for Pagoda
    decode_step: bool  # also time the engine's decode step at batch ``--decode-batch``


def build_model(spec: E2ESpec, device: torch.device, work_dir: Path):
    """(checkpoint directory, the transformers model on ``device``): a random-weight model initialised
    directly on the device and saved with a word tokenizer, or the built-in model loaded."""
    import transformers

    from common import _save_word_tokenizer, load_hf_model

    if spec.family is None:
        from pagoda.config import builtin_model_path

        path = builtin_model_path()
        return path, load_hf_model(path, spec.dtype).to(device)
    config = getattr(transformers, f"{spec.family}Config")(**spec.shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, f"{spec.family}ForCausalLM")._from_config(config, dtype=spec.dtype).eval()
    path = Path(tempfile.mkdtemp(prefix=f"{spec.key}-", dir=work_dir))
    model.save_pretrained(path, safe_serialization=True)
    _save_word_tokenizer(path, config.vocab_size)
    log(f"  {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters saved to {path}")
    return path, model


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once, except an untied input embedding
    (only the batch's rows of it are read)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    if embed is not None and lm_head is not None and embed.weight is not lm_head.weight:
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def decode_step(llm, batch: int, context: int, steps: int, vocab: int, copy_gbps: Optional[float]) -> dict:
    """Median wall time of the engine steps where exactly ``batch`` requests all decode, against the
    floor of reading the weights and every context's KV once at the measured copy bandwidth."""
    from common import random_tokens
    from offline_throughput import greedy

    engine = llm.engine
    prompts = [random_tokens(1000 + i, context - steps, vocab) for i in range(batch)]
    timed: list[tuple[float, int]] = []  # (seconds, context tokens read)
    step = engine.step

    def timed_step():
        running = engine.scheduler.running
        pure = len(running) == batch and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        read = sum(r.num_tokens for r in running)
        start = time.perf_counter()
        outputs = step()
        if pure and engine.last_step_num_tokens == batch:
            timed.append((time.perf_counter() - start, read))
        return outputs

    engine.step = timed_step  # an instance attribute shadows the method
    try:
        llm.generate(prompts, greedy(steps), use_tqdm=False)
    finally:
        del engine.step
    assert timed, "no step decoded the whole batch"
    seconds = sorted(s for s, _ in timed)[len(timed) // 2]
    shape = engine.executor.driver_worker.model_runner.kv_shape
    kv_bytes = sum(r for _, r in timed) / len(timed) * shape.bytes_per_block / shape.block_size
    weights = weight_bytes_per_step(engine.executor.driver_worker.model_runner.model)
    floor = (weights + kv_bytes) / (copy_gbps * 1e9) if copy_gbps else None
    result = {"batch": batch, "context": context, "steps_timed": len(timed), "median_step_s": seconds}
    result |= {"weight_bytes": weights, "kv_bytes": kv_bytes, "floor_s": floor}
    return result | {"floor_over_step": floor / seconds if floor else None}
