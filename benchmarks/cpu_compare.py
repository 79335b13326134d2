"""CPU comparison: Pagoda against transformers, vLLM's CPU build and llama.cpp on the same prompts.

Builds (once) the Qwen3-0.6B-shaped random-weight bf16 checkpoint, writes one workload (a 512-token
prefill prompt and decode batches of 1, 8 and 32 short prompts), and runs every system that is
installed as its own process under one protocol (``benchmarks/baselines/protocol.py``). Prints one
table of prefill and decode tokens/s plus the ratios the CPU-performance issue targets, and beside it the
host's CPU model, ISA flags, measured read bandwidth and the linear kernels the engine selected
(``cpu_facts.py``): numbers from two hosts are only comparable next to those.

transformers runs with this interpreter. vLLM CPU and llama.cpp live in their own virtual
environments (their dependencies clash with ours); point at their interpreters with
``--vllm-python`` / ``--llama-cpp-python`` or ``PAGODA_VLLM_PYTHON`` / ``PAGODA_LLAMA_CPP_PYTHON``
(README: "Comparing on CPU"). A baseline that is not installed is skipped with a message.

    python benchmarks/cpu_compare.py                       # Pagoda, Pagoda int8, transformers
    PAGODA_VLLM_PYTHON=... PAGODA_LLAMA_CPP_PYTHON=... python benchmarks/cpu_compare.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    FIRST_PLAIN_TOKEN_ID,
    QWEN3_SHAPE,
    ensure_qwen3_shape_checkpoint,
    format_table,
    log,
    machine_facts,
)
from cpu_facts import format_facts, host_facts, kernel_selection  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
RUNNERS = Path(__file__).resolve().parent / "baselines"


@dataclass(frozen=True, slots=True)
class System:
    """One row of the table: a runner script, the interpreter that runs it and its options."""

    name: str
    runner: str
    python: Optional[str]  # None: not installed
    options: tuple[str, ...] = ()
    missing_hint: str = ""


def systems(args: argparse.Namespace) -> list[System]:
    vllm_python = args.vllm_python or os.environ.get("PAGODA_VLLM_PYTHON")
    llama_python = args.llama_cpp_python or os.environ.get("PAGODA_LLAMA_CPP_PYTHON")
    hint_vllm = "set --vllm-python or PAGODA_VLLM_PYTHON (README: Comparing on CPU)"
    hint_llama = "set --llama-cpp-python or PAGODA_LLAMA_CPP_PYTHON (README: Comparing on CPU)"
    every = [
        System("pagoda", "pagoda_runner.py", sys.executable),
        System("pagoda int8", "pagoda_runner.py", sys.executable, ("--quantization", "int8")),
        System("transformers", "transformers_runner.py", sys.executable),
        System("vllm-cpu", "vllm_runner.py", vllm_python, (), hint_vllm),
        System("llama.cpp bf16", "llama_cpp_runner.py", llama_python, ("--quant", "bf16"), hint_llama),
        System("llama.cpp q8_0", "llama_cpp_runner.py", llama_python, ("--quant", "q8_0"), hint_llama),
    ]
    chosen = set(args.systems.split(",")) if args.systems else None
    return [s for s in every if chosen is None or s.name in chosen]


def make_workload(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    vocab = QWEN3_SHAPE["vocab_size"]

    def prompt(length: int) -> list[int]:
        return [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab) for _ in range(length)]

    batches = [int(b) for b in args.batches.split(",")]
    return {
        "prefill": {"prompt": prompt(args.prefill_len)},
        "decode": [
            {"batch": b, "prompts": [prompt(args.decode_prompt_len) for _ in range(b)], "new_tokens": args.new_tokens}
            for b in batches
        ],
        "repeats": args.repeats,
    }


def run_system(system: System, model_dir: Path, workload_path: Path, args: argparse.Namespace) -> dict:
    """Run one runner process; return its result, or {"error": ...}."""
    if system.python is None or not Path(system.python).exists():
        return {"skipped": f"not installed: {system.missing_hint}"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [system.python, str(RUNNERS / system.runner), "--model", str(model_dir)]
        cmd += ["--workload", str(workload_path), "--out", str(out), *system.options]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        log(f"{system.name}: {' '.join(cmd[1:2])} {' '.join(system.options)}")
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, stdout=subprocess.PIPE, stderr=None, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout} s"}
        if proc.returncode != 0 or not out.is_file():
            return {"error": f"exit code {proc.returncode}"}
        return json.loads(out.read_text())


def median_result(runs: list[dict]) -> dict:
    """Per-metric median over the rounds that produced numbers (the first failure if none did).

    Rounds interleave the systems, so a slow spell of a shared machine (memory bandwidth here varies
    by +-30% over minutes) lands on every system instead of on whichever ran during it.
    """
    ok = [r for r in runs if "prefill_tok_s" in r]
    if not ok:
        return runs[0]
    merged = dict(ok[0], rounds=len(ok))
    merged["prefill_tok_s"] = statistics.median(r["prefill_tok_s"] for r in ok)
    for key in ("decode", "decode_step_ms"):
        merged[key] = {b: statistics.median(r[key][b] for r in ok if b in r.get(key, {})) for b in ok[0].get(key, {})}
    return merged


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(results: dict[str, dict], batches: list[int], prefill_len: int) -> str:
    header = ("system", "version", f"prefill {prefill_len} tok/s", *(f"decode b{b} tok/s" for b in batches))
    rows = []
    for name, r in results.items():
        if "prefill_tok_s" not in r:
            rows.append((name, r.get("skipped") or r.get("error", "no result"), "", *("" for _ in batches)))
            continue
        decode = [_fmt(r["decode"].get(str(b))) for b in batches]
        rows.append((name, r.get("version", "?"), _fmt(r["prefill_tok_s"]), *decode))
    rows.append(tuple("" for _ in header))
    for ours, theirs in RATIOS:
        a, b = results.get(ours, {}), results.get(theirs, {})
        if "prefill_tok_s" not in a or "prefill_tok_s" not in b:
            continue
        cells = [_ratio(a["prefill_tok_s"], b["prefill_tok_s"])]
        cells += [_ratio(a["decode"].get(str(x)), b["decode"].get(str(x))) for x in batches]
        rows.append((f"{ours} / {theirs}", "ratio", *cells))
    return format_table(header, rows)


RATIOS = [
    ("pagoda", "vllm-cpu"),
    ("pagoda", "llama.cpp bf16"),
    ("pagoda int8", "llama.cpp q8_0"),
    ("pagoda int8", "vllm-cpu"),
    ("pagoda", "transformers"),
    ("pagoda int8", "pagoda"),
]


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".bench" / "qwen3-0.6b-shape")
    parser.add_argument("--systems", default=None, help="comma-separated subset, e.g. 'pagoda,vllm-cpu'")
    parser.add_argument("--vllm-python", default=None, help="interpreter of a venv with vllm-cpu installed")
    parser.add_argument("--llama-cpp-python", default=None, help="interpreter of a venv with llama-cpp-python")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per system (default: all cores)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per system")
    parser.add_argument(
        "--rounds", type=int, default=1, help="sweep all systems this many times; report per-metric medians"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=REPO_ROOT / ".bench" / "cpu_compare.json")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    model_dir = ensure_qwen3_shape_checkpoint(args.model_dir)
    facts = machine_facts()
    # Before the systems run, so the bandwidth is measured on a quiet machine. The kernel selection is the engine's
    # own (the same per-machine cache), measured here once if the cache has no entry yet.
    facts["host"] = host_facts()
    facts["host"]["kernels"] = kernel_selection()
    facts["host"]["kernels_int8"] = kernel_selection("int8")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload_path.write_text(json.dumps(make_workload(args)))
        rounds: dict[str, list[dict]] = {}
        for round_index in range(args.rounds):
            if args.rounds > 1:
                log(f"round {round_index + 1} of {args.rounds}")
            for system in systems(args):
                result = run_system(system, model_dir, workload_path, args)
                rounds.setdefault(system.name, []).append(result)
                if "skipped" in result or "error" in result:
                    log(f"{system.name}: {result.get('skipped') or result['error']}")
        results = {name: median_result(runs) for name, runs in rounds.items()}
    batches = [int(b) for b in args.batches.split(",")]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": facts, "results": results}, indent=2))
    print(
        f"\nQwen3-0.6B-shaped random weights, bf16, {facts['cpus']} CPUs ({facts['cpu']}), load {facts['load_avg_1m_start']}"
    )
    print(table(results, batches, args.prefill_len))
    print(format_facts(facts["host"]))
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
