"""MoE on CPU: a Qwen3-30B-A3B-shaped model, Pagoda (bf16, AWQ int4 experts) against transformers and llama.cpp.

The model has Qwen3-30B-A3B's shapes (``qwen3_moe_shape.json``: 128 experts of width 768, top-8 with renormalised
weights, hidden 2048, 32 query / 4 KV heads of 128, vocab 151,936, untied embeddings) but 4 of its 48 layers, so it
fits a small host (about 3.1B parameters, 6.2 GB in bf16; ~0.5B active per token). Weights are random (normal,
std 0.02; norms 1), written once straight to safetensors in the published per-expert layout
(``mlp.experts.{e}.gate_proj.weight`` ...), one shard per layer, into ``.bench/qwen3-moe-30b-a3b-shape-4l/``.

Everything else is ``cpu_compare.py``'s: the same systems, runners, protocol (prefill 512 and decode at batch 1, 8,
32 in one run), rounds and median merge. The AWQ int4 row serves the checkpoint converted by
``pagoda.testing.quant_writers`` (every decoder linear, the experts included, in AWQ int4, g128; router, embeddings
and lm_head bf16); llama.cpp's rows are GGUFs of the same weights (``baselines/gguf_export.py``, llama.cpp's
``qwen3moe`` architecture), Q4_0 / Q4_K_M by llama.cpp's own quantizer.

    PAGODA_LLAMA_CPP_PYTHON=~/venvs/llamacpp/bin/python python benchmarks/moe_compare.py --rounds 3
    python benchmarks/moe_compare.py --check     # tiny MoE: greedy tokens of Pagoda and llama.cpp vs transformers
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_compare  # noqa: E402
from common import (  # noqa: E402
    BENCH_DIR,
    FIRST_PLAIN_TOKEN_ID,
    _save_word_tokenizer,  # the synthetic word-level tokenizer every shaped checkpoint here carries
    log,
    machine_facts,
)
from cpu_facts import format_facts, host_facts  # noqa: E402

MOE_SHAPE: dict = json.loads((Path(__file__).resolve().parent / "qwen3_moe_shape.json").read_text())
MOE_SHAPE_DIR = BENCH_DIR / "qwen3-moe-30b-a3b-shape-4l"
# The correctness check's model: the same structure, small enough for fp32 transformers in seconds. The expert
# width is 128 so that AWQ's group size 128 divides every linear's input features, as it does at full size.
TINY_SHAPE: dict = dict(
    MOE_SHAPE,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
)
TINY_DIR = BENCH_DIR / "qwen3-moe-tiny"
DEFAULT_SYSTEMS = "pagoda,pagoda-awq,transformers,llamacpp-bf16,llamacpp-q4_0,llamacpp-q4_k_m"
RATIOS = [
    ("pagoda awq int4", "llama.cpp q4_k_m"),  # the target: >= 1.2x at batch 1
    ("pagoda awq int4", "llama.cpp q4_0"),
    ("pagoda awq int4", "transformers"),  # never below 1
    ("pagoda", "transformers"),
    ("pagoda", "llama.cpp bf16"),
    ("pagoda awq int4", "pagoda"),
]
INIT_STD = 0.02  # transformers' initializer_range for Qwen3-MoE


def tensor_shapes(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Qwen3-MoE checkpoint in the published per-expert layout, layer by layer."""
    hidden, head_dim, inter = shape["hidden_size"], shape["head_dim"], shape["moe_intermediate_size"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    names: list[tuple[str, tuple[int, ...]]] = []
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        names += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
        names += [(p + "self_attn.q_proj.weight", (q, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden))]
        names += [(p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, q))]
        names += [(p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,))]
        names.append((p + "mlp.gate.weight", (shape["num_experts"], hidden)))
        for e in range(shape["num_experts"]):
            names += [(f"{p}mlp.experts.{e}.{proj}_proj.weight", (inter, hidden)) for proj in ("gate", "up")]
            names.append((f"{p}mlp.experts.{e}.down_proj.weight", (hidden, inter)))
    vocab = shape["vocab_size"]
    names += [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden))]
    names.append(("model.norm.weight", (hidden,)))
    return names


def ensure_moe_checkpoint(model_dir: Path, shape: dict) -> Path:
    """Write (once) a random bf16 Qwen3-MoE checkpoint with ``shape`` into ``model_dir``: one shard per layer.

    Written tensor by tensor rather than through transformers' ``save_pretrained``, which would hold the whole
    model (twice, while un-fusing its experts) in memory.
    """
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file():
        log(f"reusing the Qwen3-MoE-shaped checkpoint in {model_dir}")
        return model_dir
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    log(f"building a Qwen3-MoE-shaped random-weight checkpoint in {model_dir} (once)")
    partial = model_dir.with_name(model_dir.name + ".partial")  # renamed when done: a killed build is never reused
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = Qwen3MoeConfig(**shape)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = torch.bfloat16
    config.save_pretrained(partial)
    generator = torch.Generator().manual_seed(0)
    shards: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, dims in tensor_shapes(shape):
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(layer, []).append((name, dims))
    weight_map, total = {}, 0
    for index, tensors in enumerate(shards.values()):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {
            name: torch.ones(dims, dtype=torch.bfloat16)
            if len(dims) == 1
            else (torch.randn(dims, generator=generator) * INIT_STD).to(torch.bfloat16)
            for name, dims in tensors
        }
        save_file(data, partial / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, file))
        total += sum(t.numel() * 2 for t in data.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    _save_word_tokenizer(partial, shape["vocab_size"])
    shutil.rmtree(model_dir, ignore_errors=True)
    partial.rename(model_dir)
    log(f"checkpoint written ({total / 2 / 1e9:.2f}B parameters, {total / 1e9:.1f} GB)")
    return model_dir


# ---- correctness on the tiny shape ---------------------------------------------------------

_LLAMA_TOKENS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from llama_cpp_runner import BatchedGreedy, ensure_gguf
from pathlib import Path
prompts, new = json.loads(sys.argv[3]), int(sys.argv[4])
engine = BatchedGreedy(ensure_gguf(Path(sys.argv[2]), "bf16"), 1024, 256, 1, 2, -1)
print(json.dumps([engine.generate([p], new)[0] for p in prompts]))
engine.close()
"""


def llama_cpp_tokens(python: str, model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """llama.cpp's BF16 greedy tokens for each prompt, one sequence at a time (in the llama.cpp venv)."""
    runners = str(cpu_compare.RUNNERS)
    cmd = [python, "-c", _LLAMA_TOKENS, runners, str(model_dir), json.dumps(prompts), str(new_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # llama.cpp logs a lot on stderr: shown only when it failed
        raise RuntimeError(f"llama.cpp failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def write_dequantized(awq_dir: Path, out: Path) -> Path:
    """The AWQ checkpoint with every quantized linear replaced by its exact float32 dequantization (what
    transformers runs for the int4 reference)."""
    from safetensors.torch import load_file, save_file

    from pagoda.quantization.formats import int_weight_from_awq

    config = json.loads((awq_dir / "config.json").read_text())
    group = config.pop("quantization_config")["group_size"]
    out.mkdir(parents=True, exist_ok=True)
    for shard in sorted(awq_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        for module in [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]:
            parts = [tensors.pop(f"{module}.{k}") for k in ("qweight", "qzeros", "scales")]
            tensors[f"{module}.weight"] = int_weight_from_awq(*parts, group_size=group).dequantize()
        save_file({k: v.float().contiguous() for k, v in tensors.items()}, out / shard.name)
    (out / "config.json").write_text(json.dumps(dict(config, dtype="float32"), indent=2))
    index = json.loads((awq_dir / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        n.replace(".qweight", ".weight"): f
        for n, f in index["weight_map"].items()
        if not n.endswith((".qzeros", ".scales"))
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(awq_dir / name, out / name)
    return out


def transformers_tokens(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' fp32 greedy tokens per prompt; fails if any checkpoint tensor went unused or missing."""
    from transformers import AutoModelForCausalLM

    from common import hf_generate

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    unread = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if unread:
        raise RuntimeError(f"transformers did not load the checkpoint as written: {unread}")
    return [hf_generate(model.eval(), [p], new_tokens)[0] for p in prompts]


def pagoda_tokens(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> list[list[int]]:
    """Pagoda's greedy tokens for all prompts, batched."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, max_num_seqs=len(prompts), enable_prefix_caching=False)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _agreement(name: str, theirs: list[list[int]], ref: list[list[int]]) -> bool:
    same = sum(a == b for a, b in zip(theirs, ref))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(theirs, ref)]
    log(
        f"{name}: {same}/{len(ref)} prompts token-identical to the transformers fp32 reference; first divergence per prompt {firsts}"
    )
    return same == len(ref)


def check(args: argparse.Namespace) -> bool:
    """Greedy tokens on the tiny shape against transformers fp32: Pagoda fp32 and llama.cpp BF16 on the bf16
    weights, Pagoda's AWQ int4 on the exactly dequantized ones; True when all three are token-identical."""
    model_dir = ensure_moe_checkpoint(TINY_DIR, TINY_SHAPE)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(FIRST_PLAIN_TOKEN_ID, TINY_SHAPE["vocab_size"]) for _ in range(rng.randint(8, 40))]
        for _ in range(8)
    ]
    new_tokens = 16
    ref = transformers_tokens(model_dir, prompts, new_tokens)
    ok = _agreement("pagoda fp32", pagoda_tokens(model_dir, prompts, new_tokens, "float32"), ref)
    _agreement("pagoda bf16 (informational)", pagoda_tokens(model_dir, prompts, new_tokens, "bfloat16"), ref)
    awq = cpu_compare.ensure_awq_checkpoint(model_dir)
    awq_ref = transformers_tokens(
        write_dequantized(awq, TINY_DIR.with_name(TINY_DIR.name + "-awq-dequantized")), prompts, new_tokens
    )
    ok &= _agreement(
        "pagoda awq int4 fp32 vs transformers on the dequantized weights",
        pagoda_tokens(awq, prompts, new_tokens, "float32"),
        awq_ref,
    )
    _agreement(
        "pagoda awq int4 bf16 vs the same (informational)", pagoda_tokens(awq, prompts, new_tokens, "bfloat16"), awq_ref
    )
    llama_python = args.llama_cpp_python or os.environ.get("PAGODA_LLAMA_CPP_PYTHON")
    if llama_python:
        ok &= _agreement("llama.cpp bf16", llama_cpp_tokens(llama_python, model_dir, prompts, new_tokens), ref)
    else:
        log("llama.cpp: not installed (set --llama-cpp-python or PAGODA_LLAMA_CPP_PYTHON)")
    return ok


# ---- the comparison ------------------------------------------------------------------------


def _prepare(model_dir: Path, shape: dict, chosen: list[cpu_compare.System]) -> dict[str, Path | str]:
    return cpu_compare.checkpoints(ensure_moe_checkpoint(model_dir, shape), chosen)


def prepare_checkpoints(model_dir: Path, shape: dict, chosen: list[cpu_compare.System]) -> dict[str, Path | str]:
    """The bf16 checkpoint and the conversions ``chosen`` needs, built in a child process: the writers leave
    gigabytes of freed-but-kept heap behind, which this process would otherwise hold while the systems run."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_prepare, model_dir, shape, chosen).result()


def run_system(system: cpu_compare.System, model_dir: Path | str, workload: Path, args: argparse.Namespace) -> dict:
    """``cpu_compare.run_system``; a llama.cpp row that segfaults (llama-cpp-python 0.3.36's AMX repack of Q4
    weights does, on AMX hosts) is rerun once with llama.cpp's extra buffers off, and its version says so."""
    result = cpu_compare.run_system(system, model_dir, workload, args)
    if system.runner == "llama_cpp_runner.py" and result.get("error") == "exit code -11":
        log(f"{system.name}: segfaulted; rerunning with --extra-bufts off (no AMX repack)")
        retry = dataclasses.replace(system, options=(*system.options, "--extra-bufts", "off"))
        result = cpu_compare.run_system(retry, model_dir, workload, args)
        if "version" in result:
            result["version"] += " (no AMX repack)"
    return result


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """cpu_compare.py's command line with this benchmark's model, systems and results file."""

    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--check", action="store_true", help="only the tiny-shape greedy-token check")
        parser.add_argument("--tiny", action="store_true", help="time the tiny shape instead (a smoke test)")

    defaults = dict(model_dir=MOE_SHAPE_DIR, systems=DEFAULT_SYSTEMS, json=BENCH_DIR / "moe_compare.json")
    return cpu_compare.parse_args(argv, description=__doc__, defaults=defaults, extra=extra)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.check:
        sys.exit(0 if check(args) else 1)
    chosen = cpu_compare.systems(args)
    shape, model_dir = (TINY_SHAPE, TINY_DIR) if args.tiny else (MOE_SHAPE, args.model_dir)
    model_dirs = prepare_checkpoints(model_dir, shape, chosen)
    facts = machine_facts()
    facts["host"] = host_facts()  # before the systems run, so the bandwidth is measured on a quiet machine
    workload = cpu_compare.make_workload(args, shape["vocab_size"])
    results = cpu_compare.run_rounds(chosen, model_dirs, workload, args, run=run_system)
    batches = [int(b) for b in args.batches.split(",")]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": facts, "shape": shape, "results": results}, indent=2))
    model = (
        f"{shape['num_hidden_layers']} of 48 layers, {shape['num_experts']} experts, top-{shape['num_experts_per_tok']}"
    )
    print(
        f"\nQwen3-30B-A3B-shaped{' (tiny)' if args.tiny else ''} ({model}) random weights, bf16 (int4 rows: quantized "
        f"from it), {facts['cpus']} CPUs ({facts['cpu']}), load {facts['load_avg_1m_start']}"
    )
    print(cpu_compare.table(results, batches, args.prefill_len, RATIOS))
    print(format_facts(facts["host"]))
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
