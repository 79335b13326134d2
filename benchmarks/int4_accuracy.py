"""How far int4 weight-only checkpoints (AWQ, GPTQ) move stories260K from its float32 model.

The built-in stories260K checkpoint (float32) is converted by ``pagoda.testing.quant_writers`` into an AWQ and a
GPTQ checkpoint, 4 bits, group size 32 by default: the model is 64 wide, so 128 (the usual size) is not possible
and 32 keeps two groups per row of the 64-wide layers, the nearest this model gets to group 128 of a 1024-wide
one. Its MLP is 172 wide, which int4 can neither pack (8 values per int32) nor group (by 32), so the writer
gets a copy whose MLP is zero-padded to 192 (extra gate/up rows and down_proj columns all zero: the same
function; printed as the first row, which should agree fully). Each quantized checkpoint is served by the
engine with its defaults (the method comes from the checkpoint) in the same activation dtype as the float model.
Each is followed by the same int4 values dequantized into a float checkpoint and run by the float kernels: the
difference between the two rows is the int4 kernels' own error. Weight-only int8 (``--quantization int8`` on
load, unpadded) is printed alongside for scale.

- Greedy: 20 story prompts (int8_accuracy.py's) x 32 new tokens, EOS ignored. Identical outputs, the mean number
  of leading tokens equal to the float model's, and the share of positions that agree.
- Log-likelihood: the float model's greedy continuations, scored by each model as a prompt (``prompt_logprobs``):
  the mean per-token log-probability under the float model, under the quantized one, and their mean change
  (quantized minus float; negative: the quantized model finds the float model's text less likely).

    python benchmarks/int4_accuracy.py [--group-size 32|64] [--methods awq,gptq] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_accuracy import PROMPTS  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.config import builtin_model_path  # noqa: E402


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``new_tokens`` greedy tokens for each token-id prompt."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def continuation_logprobs(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
    """Per-token log-probabilities of each continuation after its prompt, under ``llm`` (teacher-forced)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    sequences = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)]
    outputs = llm.generate(sequences, params, use_tqdm=False)
    result = []
    for prompt, continuation, output in zip(prompts, continuations, outputs):
        entries = output.prompt_logprobs  # entry i scores token i of the sequence; entry 0 is None
        assert entries is not None and len(entries) == len(prompt) + len(continuation)
        tokens = prompt + continuation
        result.append([entries[i][tokens[i]].logprob for i in range(len(prompt), len(tokens))])
    return result


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy agreement of ``other`` with ``base``: identical outputs, mean common prefix, positionwise share."""
    positions = sum(len(a) for a in base)
    return {
        "identical_outputs": sum(a == b for a, b in zip(base, other)),
        "outputs": len(base),
        "mean_common_prefix_tokens": statistics.mean(common_prefix(a, b) for a, b in zip(base, other)),
        "token_agreement": sum(x == y for a, b in zip(base, other) for x, y in zip(a, b)) / positions,
    }


def mean_loglik(logprobs: list[list[float]]) -> float:
    """Mean log-probability per token over every sequence."""
    return statistics.mean(x for row in logprobs for x in row)


def quantized_layers(model_dir: Path) -> dict[str, int]:
    """How many linear layers of the checkpoint hold int4 tensors (``qweight``) and how many stayed dense."""
    counts = {"quantized": 0, "dense": 0}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                if name.endswith(".qweight"):
                    counts["quantized"] += 1
                elif name.endswith("proj.weight"):
                    counts["dense"] += 1
    return counts


def write_padded_float(src: Path, multiple: int, out: Path) -> Path:
    """``src`` with its MLP width zero-padded up to a multiple of ``multiple``: the same function, packable in int4.

    The extra gate/up rows are zero, so their SiLU(0) * 0 outputs are zero, and the extra down_proj columns are
    zero too: every logit is unchanged (up to summation order).
    """
    config = json.loads((src / "config.json").read_text())
    width = config["intermediate_size"]
    padded = -(-width // multiple) * multiple
    out.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            tensors[name] = torch.nn.functional.pad(tensor, (0, 0, 0, padded - width))  # [width, hidden] -> rows
        elif name.endswith("mlp.down_proj.weight"):
            tensors[name] = torch.nn.functional.pad(tensor, (0, padded - width))  # [hidden, width] -> columns
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "intermediate_size": padded}, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    return out


def write_dequantized(quantized: Path, out: Path) -> Path:
    """A float checkpoint holding ``quantized``'s int4 weights dequantized (the engine's own reading of the format).

    Served by the float kernels, it shows what the int4 values alone cost; the gap to the quantized checkpoint's
    row is then the int4 kernels' own error (none expected beyond float rounding).
    """
    from pagoda.quantization.config import checkpoint_quant_config
    from pagoda.quantization.formats import build_quantized_weight

    config = json.loads((quantized / "config.json").read_text())
    quant_config = checkpoint_quant_config(config)
    tensors = load_file(quantized / "model.safetensors")
    dense: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("qweight", "qzeros", "scales", "g_idx"):
            modules.setdefault(module, {})[suffix] = tensor
        else:
            dense[name] = tensor
    for module, parts in modules.items():
        dense[f"{module}.weight"] = build_quantized_weight(quant_config, parts).dequantize_checkpoint_order()
    out.mkdir(parents=True)
    save_file(dense, out / "model.safetensors", metadata={"format": "pt"})
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in quantized.iterdir():
        if path.is_file() and path.name != "config.json" and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    return out


def write_checkpoint(src: Path, method: str, group_size: int, into: Path) -> Path:
    """``src`` quantized to int4 by ``method`` (awq | gptq), written under ``into``."""
    from pagoda.testing.quant_writers import write_quantized_checkpoint

    out = into / f"stories260K-{method}-int4-g{group_size}"
    write_quantized_checkpoint(src, out, method, bits=4, group_size=group_size)
    return out


def evaluate(
    name: str,
    llm: LLM,
    prompts: list[list[int]],
    base: list[list[int]],
    base_logprobs: list[list[float]],
    new_tokens: int,
) -> dict:
    """One quantized model against the float model's greedy outputs and their log-likelihood."""
    outputs = greedy(llm, prompts, new_tokens)
    logprobs = continuation_logprobs(llm, prompts, base)
    changes = [q - f for qs, fs in zip(logprobs, base_logprobs) for q, f in zip(qs, fs)]
    return {
        "name": name,
        **agreement(base, outputs),
        "mean_loglik_float": mean_loglik(base_logprobs),
        "mean_loglik_quantized": mean_loglik(logprobs),
        "mean_loglik_change": statistics.mean(changes),
        "mean_abs_logprob_change": statistics.mean(abs(c) for c in changes),
    }


def main(argv: Optional[list[str]] = None) -> None:
    """Write the checkpoints, run both models, print one JSON line per quantized model."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size (the model is 64 wide)")
    parser.add_argument("--methods", default="awq,gptq", help="comma-separated: awq, gptq")
    parser.add_argument("--dtype", default="float32", help="activation dtype of every model")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-int8", action="store_true", help="skip the weight-only int8 row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - {"awq", "gptq"}
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}: use awq and/or gptq")
    engine_args = {"dtype": args.dtype, "enable_prefix_caching": False}
    with LLM(model=str(builtin_model_path()), **engine_args) as plain:
        # The engine tokenizes the text prompts once; every later run gets the same ids.
        params = SamplingParams(max_tokens=1, temperature=0.0)
        prompts = [list(o.prompt_token_ids) for o in plain.generate(PROMPTS, params, use_tqdm=False)]
        base = greedy(plain, prompts, args.new_tokens)
        base_logprobs = continuation_logprobs(plain, prompts, base)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        # int4 packs 8 values per int32 and groups inputs by group_size; the MLP width (172) allows neither.
        padded = write_padded_float(builtin_model_path(), math.lcm(8, args.group_size), Path(tmp) / "padded")
        with LLM(model=str(padded), **engine_args) as llm:  # the yardstick: padding alone changes nothing
            results.append(evaluate("float, MLP zero-padded", llm, prompts, base, base_logprobs, args.new_tokens))
        for method in methods:
            model_dir = write_checkpoint(padded, method, args.group_size, Path(tmp))
            name = f"{method} int4 g{args.group_size}"
            with LLM(model=str(model_dir), **engine_args) as llm:
                row = evaluate(name, llm, prompts, base, base_logprobs, args.new_tokens)
            results.append({**row, "layers": quantized_layers(model_dir)})
            reference = write_dequantized(model_dir, Path(tmp) / f"{method}-dequantized")
            with LLM(model=str(reference), **engine_args) as llm:
                results.append(
                    evaluate(f"{name} dequantized, float kernels", llm, prompts, base, base_logprobs, args.new_tokens)
                )
    if not args.no_int8:
        with LLM(model=str(builtin_model_path()), quantization="int8", **engine_args) as llm:
            results.append(evaluate("int8 (on load)", llm, prompts, base, base_logprobs, args.new_tokens))
    print(
        f"stories260K, {args.dtype}, {len(prompts)} prompts x {args.new_tokens} greedy tokens against the float model"
    )
    for row in results:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
