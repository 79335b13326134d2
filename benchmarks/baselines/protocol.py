"""The measurement protocol every CPU-comparison runner follows (standard library only).

Each system runs in its own process (often its own virtual environment) as
``python <runner>.py --model DIR --workload W.json --out R.json [runner options]``. The runner builds
a ``generate(prompts, max_tokens)`` function that greedily generates exactly ``max_tokens`` tokens
(EOS ignored) for every prompt of one batch, and hands it to :func:`measure`, which times:

- prefill: one long prompt, ``max_tokens=1`` (time to first token); tokens/s = prompt length / time.
- decode at batch B: B short prompts; ``t(1 + N tokens) - t(1 token)`` isolates N decode steps;
  tokens/s = B * N / that difference. Prefill of the batch cancels out.

Prompts repeat across runs, so every runner must disable prefix/KV reuse between calls (vLLM:
``enable_prefix_caching=False``; llama.cpp: clear the KV cache before each call; Pagoda:
``enable_prefix_caching=False``): otherwise a repeated prompt is served from cache and prefill is not measured.

Every timing is the median of ``repeats`` runs after one warm-up run, so lazy initialisation
(first-call kernel selection, weight packing, thread pools) is excluded for every system alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

GenerateFn = Callable[[list[list[int]], int], None]


def parse_args(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The common runner command line; ``extra`` adds runner-specific options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--workload", required=True, help="workload JSON written by cpu_compare.py")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def load_workload(path: str) -> dict:
    """{"prefill": {"prompt": [ids]}, "decode": [{"batch": B, "prompts": [[ids]...], "new_tokens": N}],
    "repeats": R, "sections": ["prefill", "decode"]}"""
    return json.loads(Path(path).read_text())


def progress(message: str) -> None:
    print(f"[runner] {message}", file=sys.stderr, flush=True)


def _timed(generate: GenerateFn, prompts: list[list[int]], max_tokens: int, repeats: int) -> float:
    generate(prompts, max_tokens)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(prompts, max_tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(generate: GenerateFn, workload: dict) -> dict:
    """Run the workload's sections through ``generate``; return tokens/s per section."""
    repeats = int(workload.get("repeats", 3))
    result: dict = {"decode": {}, "decode_step_ms": {}}
    if "prefill" in workload.get("sections", ["prefill", "decode"]):
        prompt = workload["prefill"]["prompt"]
        seconds = _timed(generate, [prompt], 1, repeats)
        result["prefill_tok_s"] = len(prompt) / seconds
        progress(f"prefill {len(prompt)} tokens: {seconds * 1e3:.0f} ms ({result['prefill_tok_s']:.1f} tok/s)")
    if "decode" in workload.get("sections", ["prefill", "decode"]):
        for case in workload["decode"]:
            batch, prompts, new_tokens = case["batch"], case["prompts"], case["new_tokens"]
            first = _timed(generate, prompts, 1, repeats)
            full = _timed(generate, prompts, 1 + new_tokens, repeats)
            decode_seconds = max(full - first, 1e-9)
            result["decode"][str(batch)] = batch * new_tokens / decode_seconds
            result["decode_step_ms"][str(batch)] = decode_seconds / new_tokens * 1e3
            progress(f"decode batch {batch}: {result['decode'][str(batch)]:.1f} tok/s")
    return result


def write_result(path: str, system: str, version: str, measured: dict, **extra: object) -> None:
    """Write the runner's result JSON (what cpu_compare.py reads back)."""
    payload = {"system": system, "version": version, **measured, **extra}
    Path(path).write_text(json.dumps(payload, indent=2))
