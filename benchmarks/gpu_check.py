"""One bounded GPU check of the Triton path: the gpu tests, device copy bandwidth and every kernel
against its torch reference (and SDPA), and the engine end to end against transformers on a
Qwen3-0.6B-shaped and a Llama-3-8B-shaped random-weight model. Prints one table, writes it as JSON.

    python benchmarks/gpu_check.py                 # on one GPU, within --budget seconds (default 440) + startup
    python benchmarks/gpu_check.py --smoke         # every section on CPU with tiny shapes (the logic only)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, log, machine_facts, machine_rows  # noqa: E402 (not a package)
from gpu_common import Budget, copy_bandwidth, run_pytest  # noqa: E402
from gpu_kernels import kernel_rows, run_kernels  # noqa: E402
from gpu_models import LLAMA8B_SHAPE, TINY_LLAMA_SHAPE, E2ESpec, build_model, decode_step  # noqa: E402
from gpu_quant import quant_rows, run_quant  # noqa: E402
from gpu_tp import run_tp, tp_rows  # noqa: E402


def e2e_specs(smoke: bool) -> list[E2ESpec]:
    from common import QWEN3_SHAPE

    if smoke:
        return [
            E2ESpec("stories", "stories260K (built-in)", None, None, torch.float32, 20, 10, True),
            E2ESpec("tiny-llama", "tiny Llama-3, random", "Llama", TINY_LLAMA_SHAPE, torch.float32, 20, 10, False),
        ]
    return [
        E2ESpec("qwen3", "Qwen3-0.6B shape, random bf16", "Qwen3", QWEN3_SHAPE, torch.bfloat16, 80, 45, False),
        E2ESpec("llama8b", "Llama-3-8B shape, random bf16", "Llama", LLAMA8B_SHAPE, torch.bfloat16, 170, 100, True),
    ]


def _on_device(model, device: torch.device) -> SimpleNamespace:
    """Lets ``common.hf_generate`` (which builds CPU tensors) drive a model on another device."""
    move = lambda kwargs: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return SimpleNamespace(generate=lambda **kwargs: model.generate(**move(kwargs)).cpu())


def hf_baseline(model, workload, batch_size: int, device: torch.device, cap_s: float) -> dict:
    """transformers static batches over the workload's prompts in order, until ``cap_s`` is spent."""
    from common import Workload, hf_static_batches

    parts, started = [], time.monotonic()
    for first in range(0, len(workload.prompts), batch_size):
        begun, chunk = time.monotonic(), slice(first, first + batch_size)
        batch = Workload(workload.prompts[chunk], workload.output_lens[chunk])
        parts.append(hf_static_batches(_on_device(model, device), batch, batch_size))
        # stop when another batch as long as this one would pass the cap
        if first + batch_size < len(workload.prompts) and 2 * time.monotonic() - begun - started > cap_s:
            log(f"  transformers: stopping after {first + batch_size} prompts (cap {cap_s:.0f} s)")
            break
    total = {name: sum(getattr(p, name) for p in parts) for name in ("num_prompts", "seconds", "output_tokens")}
    result = {"prompts": total["num_prompts"], "of_prompts": len(workload.prompts), "batch_size": batch_size}
    result |= {"seconds": total["seconds"], "output_tokens": total["output_tokens"]}
    result["generated_tokens"] = sum(p.generated_tokens for p in parts)  # incl. padding to each batch's longest
    return result | {"output_tokens_per_s": total["output_tokens"] / total["seconds"]}


def make_llm(path: Path, spec: E2ESpec, max_model_len: int, device: torch.device):
    """Pagoda with its defaults (Triton attention and CUDA graphs on a GPU); if this engine has no
    Triton backend yet, the default backend, said so in the result."""
    from pagoda import LLM

    kwargs = dict(model=str(path), dtype=str(spec.dtype).removeprefix("torch."), max_model_len=max_model_len)
    if device.type != "cuda":
        return LLM(**kwargs), ""
    try:
        return LLM(attention_backend="triton", **kwargs), ""
    except ValueError as exc:
        note = f"attention_backend='triton' refused ({exc}); fell back to the default backend"
        log(f"  WARNING {note}")
    gc.collect()
    torch.cuda.empty_cache()
    return LLM(**kwargs), note


def engine_facts(llm, note: str) -> dict:
    engine = llm.engine
    runner = engine.executor.driver_worker.model_runner
    graphs = getattr(runner, "cuda_graphs", None)
    facts = {"backend": type(runner.attn_backend).__name__, "note": note}
    facts["cuda_graph_sizes"] = len(graphs.sizes) if graphs is not None else 0  # 0: every step eager
    return facts | {"num_blocks": engine.get_stats().num_blocks, "max_num_seqs": engine.scheduler.config.max_num_seqs}


def run_e2e_model(spec: E2ESpec, args: argparse.Namespace, budget: Budget, device, copy_gbps, result: dict) -> None:
    """transformers static batches, then Pagoda, on the same workload; then Pagoda's decode step.
    Fills ``result`` as it goes, so what was measured survives a later failure."""
    from common import make_workload
    from offline_throughput import ModelSpec, pagoda_throughput

    vocab, a = spec.shape["vocab_size"] if spec.shape else 512, args
    prompt_range, output_range = tuple(a.prompt_range), (a.output_len, a.output_len)
    workload = make_workload(a.seed, a.num_prompts, prompt_range, output_range, vocab)
    result["workload"] = {"prompts": a.num_prompts, "prompt_len_range": prompt_range, "output_len": a.output_len}
    log(f"[{spec.key}] building the model")
    path, model = build_model(spec, device, a.work_dir)
    try:
        cap = min(a.hf_seconds, budget.left() - spec.pagoda_need_s)
        log(f"[{spec.key}] transformers static batches of {a.hf_batch_size} (cap {cap:.0f} s)")
        skip = {"skipped": "no time left for transformers"}
        result["hf"] = hf_baseline(model, workload, a.hf_batch_size, device, cap) if cap > 0 else skip
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # Pagoda sizes its KV cache from the free memory
        max_model_len = max(prompt_range[1] + a.output_len, a.decode_context + 1 if spec.decode_step else 0)
        log(f"[{spec.key}] Pagoda: loading (max_model_len {max_model_len})")
        llm, note = make_llm(path, spec, max_model_len, device)
        result["engine"] = engine_facts(llm, note)
        log(f"[{spec.key}] Pagoda: {a.num_prompts} prompts ({result['engine']['backend']})")
        model_spec = ModelSpec(spec.key, spec.label, path, spec.dtype, vocab, prompt_range, output_range, 0, None, 0)
        pagoda, _ = pagoda_throughput(llm, model_spec, workload, a.seed)
        result["pagoda"] = {k: v for k, v in pagoda.items() if k != "kv_waste"}
        log(f"[{spec.key}]   {pagoda['output_tokens_per_s']:.1f} output tok/s")
        if spec.decode_step and budget.allows(15, f"[{spec.key}] decode step"):
            log(f"[{spec.key}] decode step at batch {a.decode_batch}, context {a.decode_context}")
            result["decode_step"] = decode_step(llm, a.decode_batch, a.decode_context, a.decode_steps, vocab, copy_gbps)
    finally:
        if spec.family is not None:
            shutil.rmtree(path, ignore_errors=True)


def run_e2e(args: argparse.Namespace, budget: Budget, device, copy_gbps: Optional[float], results: dict) -> None:
    """Each model in turn, its results filled into ``results[key]`` as they come."""
    for spec in [s for s in e2e_specs(args.smoke) if s.key in args.model_keys]:
        results[spec.key] = result = {"label": spec.label, "dtype": str(spec.dtype).removeprefix("torch.")}
        if not budget.allows(spec.need_s, f"[{spec.key}] end to end"):
            result["skipped"] = f"less than {spec.need_s:.0f} s left"
            continue
        try:
            run_e2e_model(spec, args, budget, device, copy_gbps, result)
        except Exception as exc:  # the other model still runs
            log(f"[{spec.key}] ERROR {type(exc).__name__}: {exc}")
            result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _e2e_rows(key: str, r: dict) -> list[tuple[str, ...]]:
    """Rows of whatever one model measured, then why it stopped (skipped, or an error)."""
    rows, w, p, hf = [], r.get("workload"), r.get("pagoda"), r.get("hf", {})
    if "engine" in r:
        e = r["engine"]
        rows += [(key, "model", r["label"], f"{r['dtype']}; {e['backend']}, {e['cuda_graph_sizes']} CUDA graph sizes")]
        rows += [(key, "", "", e["note"])] if e["note"] else []
    if w:
        shape = (
            f"prompt {w['prompt_len_range'][0]}-{w['prompt_len_range'][1]} tok, output {w['output_len']} tok, greedy"
        )
        rows += [(key, "workload", f"{w['prompts']} prompts", shape)]
    if p:
        detail = f"{p['output_tokens']} tok in {p['seconds']:.2f} s"
        rows += [(key, "Pagoda output tok/s", f"{p['output_tokens_per_s']:.1f}", detail)]
    if "output_tokens_per_s" in hf:
        subset = "all" if hf["prompts"] == hf["of_prompts"] else f"SUBSET (time cap): first {hf['prompts']} of"
        detail = f"{subset} {hf['of_prompts']} prompts; {hf['generated_tokens']} tok generated incl. padding"
        rows.append((key, f"HF static batch {hf['batch_size']} tok/s", f"{hf['output_tokens_per_s']:.1f}", detail))
        ratio = f"{p['output_tokens_per_s'] / hf['output_tokens_per_s']:.1f}x" if p else "-"
        rows.append((key, "  Pagoda / HF", ratio, ""))
    rows += [(key, "HF static tok/s", "SKIPPED", hf["skipped"])] if "skipped" in hf else []
    if "decode_step" in r:
        d = r["decode_step"]
        floor = f"floor {d['floor_s'] * 1e3:.2f} ms" if d["floor_s"] else "floor unknown"
        pct = f", floor/step {d['floor_over_step']:.0%}" if d["floor_s"] else ""
        read = f"({d['weight_bytes'] / 1e9:.2f} GB weights + {d['kv_bytes'] / 1e9:.2f} GB KV) / copy BW"
        rows.append(
            (key, f"decode step, batch {d['batch']}", f"{d['median_step_s'] * 1e3:.2f} ms", f"{floor} = {read}{pct}")
        )
        rows.append((key, "", "", f"median of {d['steps_timed']} steps at context ~{d['context']} tok, wall time"))
    for status in ("skipped", "error"):
        rows += [(key, r["label"], status.upper(), r[status])] if status in r else []
    if not p and not {"skipped", "error"} & r.keys():
        rows.append((key, r["label"], "INCOMPLETE", "stopped by the deadline watchdog"))
    return rows


def table_rows(facts: dict, results: dict) -> list[tuple[str, ...]]:
    rows, gap = machine_rows(facts), ("", "", "", "")
    if "pytest" in results:
        t = results["pytest"]
        counts = ", ".join(f"{n} {word}" for word, n in t.get("counts", {}).items()) or "no summary"
        state = (
            t.get("error") or ("TIMED OUT" if t["timed_out"] else f"rc {t['returncode']}") + f", {t['seconds']:.0f} s"
        )
        rows += [gap, ("pytest", t.get("command", "gpu tests"), counts, state)]
        rows += [("pytest", "failed", "", name) for name in t.get("failed_tests", [])]
    bw = results.get("bandwidth", {"error": "not measured"})
    detail = bw.get("error") or f"{bw['bytes'] / 2**30:.2f} GiB moved (read + write), {bw['method']}"
    rows += [gap, ("bandwidth", "device copy", f"{bw.get('gb_per_s', 0):.0f} GB/s", detail)]
    rows += kernel_rows(results.get("kernels", {"skipped_groups": "all"}))
    rows += tp_rows(results.get("tp", {}))
    rows += quant_rows(results.get("quant", {}))
    for key, r in results["e2e"].items():  # "error": the section itself failed
        rows += [gap, *(_e2e_rows(key, r) if isinstance(r, dict) else [("e2e", "ERROR", "", r)])]
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="every section on CPU (or the GPU) with tiny shapes: proves the logic")
    add("--json", type=Path, help="also write the results here (default: $OUT/gpu_check.json when OUT is set)")
    add("--budget", type=float, default=440, help="seconds for the whole run; later sections are skipped past it")
    add("--pytest-timeout", type=float, default=120, help="seconds for the gpu tests (0 skips them)")
    add("--grace", type=float, default=20, help="past budget + grace a watchdog prints what was measured and exits")
    add("--kernel-seconds", type=float, default=60, help="seconds for the kernel measurements (0 skips them)")
    add("--tp-seconds", type=float, default=240, help="cap on the tensor-parallel section (2+ GPUs; 0 skips it)")
    add("--quant-seconds", type=float, default=45, help="cap on the quantized GEMM section (0 skips it)")
    add("--models", default=None, help="comma-separated e2e models (default: qwen3,llama8b; smoke: stories,tiny-llama)")
    add("--num-prompts", type=int, default=256)
    add("--output-len", type=int, default=128)
    add("--hf-batch-size", type=int, default=64)
    add("--hf-seconds", type=float, default=40, help="cap on each model's transformers baseline")
    add("--work-dir", type=Path, default=Path(tempfile.gettempdir()), help="checkpoints go in a folder here")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu_check.json"
    smoke = args.smoke
    args.model_keys = (args.models or ("stories,tiny-llama" if smoke else "qwen3,llama8b")).split(",")
    args.prompt_range = (8, 24) if smoke else (32, 128)
    args.num_prompts, args.output_len = (8, 8) if smoke else (args.num_prompts, args.output_len)
    args.decode_batch, args.decode_context, args.decode_steps = (4, 64, 8) if smoke else (64, 2048, 32)
    args.warmup, args.reps = (1, 2) if smoke else (3, 10)
    args.copy_bytes = 16 * 2**20 if smoke else 2 * 2**30
    return args


def _section(name: str, run) -> dict:
    """One section's result; an exception becomes {"error": ...} so the rest of the table survives."""
    try:
        return run()
    except Exception as exc:
        log(f"ERROR in {name}: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def report(args: argparse.Namespace, facts: dict, results: dict) -> None:
    """Print the table; write it, the results and the settings as JSON when asked."""
    facts["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    rows = table_rows(facts, results)
    print(format_table(("section", "measurement", "value", "detail"), rows), flush=True)
    if args.json is not None:
        payload = {"machine": facts, "settings": vars(args), "results": results, "table": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        log(f"wrote {args.json}")


def _overrun(args: argparse.Namespace, facts: dict, results: dict) -> None:
    """The watchdog: past the budget and its grace, report what was measured and stop at once."""
    log(f"DEADLINE: {args.budget + args.grace:.0f} s passed mid-section; reporting what was measured and exiting")
    report(args, facts, results)
    shutil.rmtree(args.work_dir, ignore_errors=True)  # os._exit skips the finally that removes checkpoints
    os._exit(3)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    budget = Budget(args.budget)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            sys.exit("no CUDA device: this check needs a GPU (--smoke runs its logic on CPU)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    args.work_dir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.work_dir))  # this run's checkpoints
    facts, results = machine_facts(), {"tp": {}, "quant": {}, "e2e": {}}  # filled as sections finish (watchdog too)
    watchdog = threading.Timer(args.budget + args.grace, _overrun, (args, facts, results))
    watchdog.daemon = True
    watchdog.start()
    if args.pytest_timeout > 0 and budget.allows(30, "pytest"):
        results["pytest"] = _section("pytest", lambda: run_pytest(min(args.pytest_timeout, budget.left() - 30)))
    log(f"device copy bandwidth ({args.copy_bytes / 2**20:.0f} MiB buffer)")
    measure = lambda: copy_bandwidth(device, args.copy_bytes, args.warmup, args.reps)
    results["bandwidth"] = _section("bandwidth", measure)
    copy_gbps = results["bandwidth"].get("gb_per_s")
    if args.kernel_seconds > 0 and budget.allows(20, "kernels"):
        seconds, gbps = min(args.kernel_seconds, budget.left()), copy_gbps or float("nan")
        run = lambda: run_kernels(args.smoke, seconds, args.warmup, args.reps, device, gbps)
        results["kernels"] = _section("kernels", run)
    results["tp"] |= _section("tp", lambda: run_tp(args, budget, results["tp"]) or {})
    results["quant"] |= _section("quant", lambda: run_quant(args, budget, results["quant"]) or {})
    results["e2e"] |= _section("e2e", lambda: run_e2e(args, budget, device, copy_gbps, results["e2e"]) or {})
    watchdog.cancel()
    shutil.rmtree(args.work_dir, ignore_errors=True)
    report(args, facts, results)
    log(f"done, {budget.left():.0f} s of the budget left")


if __name__ == "__main__":
    main()
