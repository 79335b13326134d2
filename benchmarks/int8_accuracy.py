"""How far weight-only int8 (``--quantization int8``) moves stories260K from the unquantized model.

Greedy: 20 story prompts x 32 new tokens through the engine, int8 against the unquantized model in
the same dtype; bf16 (no quantization) against float32 is printed alongside as the yardstick of what a
mere rounding change does to this 64-wide model. Logits: every position of the 20 prompts plus the
unquantized model's greedy continuations, teacher-forced through both models; max absolute error, RMS
error relative to the logits' RMS, and top-1 agreement.

    python benchmarks/int8_accuracy.py
"""

from __future__ import annotations

import argparse
import json

import torch

from pagoda import LLM, SamplingParams
from pagoda.attention.protocol import build_metadata
from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.config import builtin_model_path
from pagoda.layers.linear_kernels import prepare_linear_layers
from pagoda.loader import load_model

PROMPTS = [
    f"{start}{tail}"
    for start in ["Once upon a time", "The little dog", "Lily wanted to", "One day, a boy named Tom", "The sun was"]
    for tail in ["", " and", " in the park", " very"]
]


def greedy(llm: LLM, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def logits_of(model_dir: str, dtype: torch.dtype, quantization: str | None, sequences: list[list[int]]) -> torch.Tensor:
    """Teacher-forced logits of every position but the last: [sum of (length - 1), vocab] float32."""
    model = load_model(model_dir, TorchAttentionBackend(), dtype)
    prepare_linear_layers(model, torch.device("cpu"), dtype, quantization)
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec
    block_size, rows = 16, []
    for tokens in sequences:
        num_blocks = -(-len(tokens) // block_size)
        caches = [
            torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)
        ]
        meta = build_metadata([len(tokens)], [len(tokens)], [list(range(num_blocks))], block_size)
        with torch.inference_mode():
            hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), caches, meta)
            rows.append(model.compute_logits(hidden)[:-1].float())
    return torch.cat(rows)


def compare(name: str, base: list[list[int]], other: list[list[int]]) -> dict:
    identical = sum(a == b for a, b in zip(base, other))
    prefix32 = sum(a[:32] == b[:32] for a, b in zip(base, other))
    tokens = sum(x == y for a, b in zip(base, other) for x, y in zip(a, b)) / sum(len(a) for a in base)
    return {"name": name, "identical_outputs": identical, "first_32_identical": prefix32, "token_agreement": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for dtype in ("float32", "bfloat16"):
        plain = LLM(dtype=dtype, enable_prefix_caching=False)
        int8 = LLM(dtype=dtype, enable_prefix_caching=False, quantization="int8")
        base, quant = greedy(plain, args.new_tokens), greedy(int8, args.new_tokens)
        results.append(compare(f"int8 vs {dtype}", base, quant))
        sequences = [plain.engine.tokenizer.encode(p) + out for p, out in zip(PROMPTS, base)]
        model_dir, torch_dtype = str(builtin_model_path()), getattr(torch, dtype)
        a = logits_of(model_dir, torch_dtype, None, sequences)
        b = logits_of(model_dir, torch_dtype, "int8", sequences)
        results[-1].update(
            logits_max_abs=float(a.abs().max()),
            max_abs_logit_error=float((a - b).abs().max()),
            rms_logit_error_relative=float((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt()),
            top1_agreement=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        )
        if dtype == "float32":
            fp32_base = base
        else:
            results.append(compare("bf16 vs float32 (no quantization)", fp32_base, base))
    for r in results:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
