"""Decode throughput with LoRA adapters against the base model alone, in one run on one machine.

A Qwen3-0.6B-shaped bf16 model (random weights) and four rank-16 adapters on q/k/v/o/gate/up/down. Three
configurations decode the same batch (32 requests, 32-token prompts, 64 new tokens each, EOS ignored):

- ``base``: the engine without LoRA;
- ``lora-on, base requests``: LoRA enabled, every request on the base model (what enabling costs);
- ``4 adapters``: LoRA enabled, the 32 requests spread evenly over the four adapters.

Only steps in which every request decodes are timed (prefill excluded). The issue's target: the adapter mix at
most 1.3x slower than the base on CPU.

    python benchmarks/lora_throughput.py                  # batch 32
    python benchmarks/lora_throughput.py --batch 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    BENCH_DIR,
    FIRST_PLAIN_TOKEN_ID,
    QWEN3_SHAPE,
    ensure_qwen3_shape_checkpoint,
    format_table,
    log,
    machine_facts,
)

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def projection_shapes() -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of the Qwen3-0.6B shape."""
    hidden, inter = QWEN3_SHAPE["hidden_size"], QWEN3_SHAPE["intermediate_size"]
    q = QWEN3_SHAPE["num_attention_heads"] * QWEN3_SHAPE["head_dim"]
    kv = QWEN3_SHAPE["num_key_value_heads"] * QWEN3_SHAPE["head_dim"]
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(folder: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) written directly: building it with
    PEFT would load the 0.6B model in fp32 first. The tests hold the engine's reader to PEFT's own files."""
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(), {}
    for layer in range(QWEN3_SHAPE["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                in_features, out_features = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen) * 0.02).bfloat16()
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.02).bfloat16()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = [n for names in PROJECTIONS.values() for n in names]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def decode_throughput(engine, batch: int, adapters: list[Optional[str]], new_tokens: int) -> float:
    """Output tokens per second over the steps in which all ``batch`` requests decode."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [FIRST_PLAIN_TOKEN_ID + (i * 37 + j) % 5000 for j in range(32)]
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_name=adapters[i % len(adapters)])
    decode_time, decode_tokens = 0.0, 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        all_decoding = len(running) == batch and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        start = time.perf_counter()
        engine.step()
        if all_decoding:
            decode_time += time.perf_counter() - start
            decode_tokens += batch
    return decode_tokens / decode_time


def run(args: argparse.Namespace) -> dict:
    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.lora.sources import LoRAModule

    model_dir = ensure_qwen3_shape_checkpoint()
    folders = [write_adapter(BENCH_DIR / f"lora-r{args.rank}-{i}", args.rank, i) for i in range(4)]
    common = dict(model=str(model_dir), max_model_len=512, max_num_seqs=args.batch, kv_cache_memory="1GiB")
    results: dict[str, list[float]] = {"base": [], "lora-on, base requests": [], "4 adapters": []}
    log("loading the engine without LoRA")
    plain = LLMEngine(EngineArgs(**common))
    log("loading the engine with LoRA (4 slots)")
    lora = LLMEngine(EngineArgs(**common, enable_lora=True, max_loras=4, max_lora_rank=args.rank))
    for i, folder in enumerate(folders):
        lora.add_lora(LoRAModule(f"adapter{i}", str(folder)))
    names = [f"adapter{i}" for i in range(4)]
    for repeat in range(args.repeats):  # interleaved, so drift on the host hits all three alike
        results["base"].append(decode_throughput(plain, args.batch, [None], args.new_tokens))
        results["lora-on, base requests"].append(decode_throughput(lora, args.batch, [None], args.new_tokens))
        results["4 adapters"].append(decode_throughput(lora, args.batch, names, args.new_tokens))
        log(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items()))
    return {name: statistics.median(values) for name, values in results.items()}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    facts = machine_facts()
    medians = run(args)
    base = medians["base"]
    rows = [(name, f"{tok_s:.1f}", f"{base / tok_s:.2f}x") for name, tok_s in medians.items()]
    print(f"\nLoRA decode throughput, Qwen3-0.6B shape bf16, batch {args.batch}, rank {args.rank}, {facts['cpu']}")
    print(format_table(("configuration", "decode tok/s (median)", "slowdown vs base"), rows))


if __name__ == "__main__":
    main()
