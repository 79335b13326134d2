"""The tensor-parallel section of benchmarks/gpu_check.py (2+ GPUs; with fewer it records "skipped" and costs
nothing). Two random-weight checkpoints, each served at TP=1, 2 (and 4 on 4+ GPUs), max_num_seqs 32, CUDA graphs
on (the default):

* ``check``: a small Llama-3-shaped model in fp32 (untied lm_head, a vocabulary no TP size divides, so the last
  vocab shard is padded; 2 KV heads, replicated at TP=4). The greedy tokens of a few prompts at TP=N must equal
  TP=1's and their logprobs agree within FP32_LOGPROB_TOL: the only differences are the summation order of the
  all-reduces and the attention split count, ~1e-6 of a logprob.
* ``time``: the Qwen3-0.6B shape in bf16 (tied embeddings). Decode tok/s at batch 1 and 32 (median engine step where
  the whole batch decodes), a 512-token prefill (median wall time of ``generate(max_tokens=1)``), rank 0's memory,
  and the same greedy comparison, informational only: in bf16 the changed summation order moves logits by ~1e-2, so
  a prompt diverges after its first near-tie; a broken shard shows as disagreement from the first token of most
  prompts and logprob differences of order 1.

Each engine runs in its own spawned process (rank 0; it spawns ranks 1..N-1), so an NCCL abort, a segfault or a
hang kills that process, not gpu_check: the parent records what came back, the exit code or the timeout, and goes on.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import shutil
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from common import log  # noqa: E402 (the benchmarks folder is not a package)
from gpu_common import Budget  # noqa: E402
from gpu_models import LLAMA8B_SHAPE, TINY_LLAMA_SHAPE, E2ESpec, build_model, decode_step  # noqa: E402

MAX_NUM_SEQS = 32  # 7 CUDA graph sizes (1, 2, 4, 8, 16, 24, 32) instead of 35: captures stay short
TIMEOUT_S = 60.0  # distributed_timeout_seconds (the engine's default)
FP32_LOGPROB_TOL = 1e-3
MIN_SECTION_S = 60
PROMPT_LENS = (7, 16, 33, 64, 100, 200)  # the greedy prompts (smoke: the first four)


@dataclass(frozen=True, slots=True)
class TPModel:
    kind: str  # check | time
    label: str
    family: str
    shape: dict
    dtype: torch.dtype
    max_model_len: int
    need_s: float  # one engine's start and run; skipped when the section has less left
    cap_s: float  # its process is killed past this


def tp_models(smoke: bool) -> dict[str, TPModel]:
    from common import QWEN3_SHAPE

    if smoke:
        llama = TINY_LLAMA_SHAPE | {"vocab_size": 515}
        qwen = QWEN3_SHAPE | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
        qwen |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        return {
            "check": TPModel("check", "tiny Llama-3, fp32", "Llama", llama, torch.float32, 256, 20, 120),
            "time": TPModel("time", "tiny Qwen3, bf16", "Qwen3", qwen, torch.bfloat16, 256, 20, 120),
        }
    llama = LLAMA8B_SHAPE | {"vocab_size": 32003, "hidden_size": 1024, "intermediate_size": 2816, "head_dim": 64}
    llama |= {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2}
    return {
        "check": TPModel("check", "Llama-3 4 layers x 1024, fp32", "Llama", llama, torch.float32, 512, 35, 150),
        "time": TPModel("time", "Qwen3-0.6B shape, bf16", "Qwen3", QWEN3_SHAPE, torch.bfloat16, 1024, 50, 200),
    }


def run_tp(args, budget: Budget, result: dict) -> None:
    """The section: fills ``result`` as it goes (the watchdog may report it at any moment)."""
    gpus = torch.cuda.device_count()
    result["gpus"] = gpus
    if gpus < 2:
        result["skipped"] = f"{gpus} GPU(s)"
        return
    if args.tp_seconds <= 0:
        result["skipped"] = "--tp-seconds 0"
        return
    if not budget.allows(MIN_SECTION_S, "tensor parallel"):
        result["skipped"] = f"less than {MIN_SECTION_S} s left"
        return
    gc.collect()
    torch.cuda.empty_cache()  # each engine sizes its KV cache from the free memory of its device
    sizes = [n for n in (1, 2, 4) if n <= gpus]
    run_sizes(args.smoke, args.work_dir, min(args.tp_seconds, budget.left()), sizes, "cuda", result)


def run_sizes(smoke: bool, work_dir: Path, seconds: float, sizes: list[int], device: str, result: dict) -> None:
    """Every (model, size) engine in turn: TP=1 and 2 of both models first, then TP=4."""
    section, models = Budget(seconds), tp_models(smoke)
    result |= {"sizes": sizes, "models": {m.kind: m.label for m in models.values()}, "jobs": {}}
    plan = sorted(((kind, n) for n in sizes for kind in models), key=lambda j: (j[1] > 2, j[0] != "check", j[1]))
    paths: dict[str, Optional[Path]] = {}
    built_error: dict[str, str] = {}
    try:
        for kind, tp in plan:
            model, key = models[kind], f"{kind}/tp{tp}"
            job = result["jobs"][key] = {}
            if not section.allows(model.need_s, f"[tp] {key}"):
                job["skipped"] = f"less than {model.need_s:.0f} s left in the section"
                continue
            if kind not in paths:
                try:
                    paths[kind] = _build(model, device, work_dir)
                except Exception as exc:
                    paths[kind], built_error[kind] = None, f"{type(exc).__name__}: {exc}"[:300]
                    log(f"[tp] ERROR building the {kind} checkpoint: {built_error[kind]}")
            if paths[kind] is None:
                job["error"] = f"no checkpoint: {built_error[kind]}"
                continue
            spec = _job_spec(model, tp, paths[kind], device, smoke)
            log(
                f"[tp] {key}: {model.label} at tensor_parallel_size={tp} (cap {min(model.cap_s, section.left()):.0f} s)"
            )
            _run_job(spec, min(model.cap_s, section.left()), job)
    finally:
        for path in paths.values():
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)


def _build(model: TPModel, device: str, work_dir: Path) -> Path:
    log(f"[tp] building the {model.kind} checkpoint ({model.label})")
    spec = E2ESpec(f"tp-{model.kind}", model.label, model.family, model.shape, model.dtype, 0, 0, False)
    path, hf_model = build_model(spec, torch.device(device, 0) if device == "cuda" else torch.device(device), work_dir)
    del hf_model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def _job_spec(model: TPModel, tp: int, path: Path, device: str, smoke: bool) -> dict:
    from common import random_tokens

    vocab = model.shape["vocab_size"]
    lens = PROMPT_LENS[:4] if smoke else PROMPT_LENS
    spec = {"kind": model.kind, "tp": tp, "path": str(path), "device": device, "vocab": vocab}
    spec |= {"dtype": str(model.dtype).removeprefix("torch."), "max_model_len": model.max_model_len}
    spec |= {
        "prompts": [random_tokens(100 + i, n, vocab) for i, n in enumerate(lens)],
        "new_tokens": 8 if smoke else 32,
    }
    timing = model.kind == "time"
    spec["decode_batches"] = (1, MAX_NUM_SEQS) if timing else ()
    spec |= {"decode_context": 64 if smoke else 512, "decode_steps": 8 if smoke else 64}
    return spec | {"prefill_tokens": (128 if smoke else 512) if timing else 0, "prefill_reps": 3}


# ---- the parent's side of one engine process ---------------------------------------------------


def _run_job(spec: dict, timeout_s: float, result: dict) -> None:
    """Start the engine process and copy what it sends into ``result`` until it is done, dies or times out."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=False)
    # not a daemon: the engine spawns its own worker processes (it watches this process instead)
    process = context.Process(target=_engine_job, args=(theirs, spec), name=f"gpu-tp-{spec['kind']}-{spec['tp']}")
    begun, deadline = time.monotonic(), time.monotonic() + timeout_s
    process.start()
    theirs.close()
    try:
        while "done" not in result:
            if not ours.poll(max(deadline - time.monotonic(), 0)):
                result.setdefault("error", f"no result within {timeout_s:.0f} s: engine process killed")
                break
            try:
                name, value = ours.recv()
            except EOFError:
                process.join(10)
                result.setdefault("error", f"engine process ended early (exit code {process.exitcode})")
                break
            result[name] = value
    finally:
        process.join(30 if "done" in result else 0)
        if process.is_alive():
            process.kill()
            process.join()
        if process.exitcode != 0:
            time.sleep(3)  # its workers notice within a second or two and exit, freeing their devices
        ours.close()
    result["seconds"] = time.monotonic() - begun
    log(f"[tp]   {result.get('error') or 'done'} ({result['seconds']:.0f} s)")


# ---- the engine process ------------------------------------------------------------------------


def _engine_job(conn, spec: dict) -> None:
    """Process entry: one engine, rank 0 of ``spec['tp']``; each result is sent as soon as it is measured."""
    _exit_with_parent()
    llm = None
    try:
        from pagoda import LLM

        begun = time.monotonic()
        llm = LLM(
            model=spec["path"],
            dtype=spec["dtype"],
            device=spec["device"],
            max_model_len=spec["max_model_len"],
            max_num_seqs=MAX_NUM_SEQS,
            tensor_parallel_size=spec["tp"],
            distributed_timeout_seconds=TIMEOUT_S,
        )
        conn.send(("engine", _engine_facts(llm, time.monotonic() - begun)))
        conn.send(("greedy", _greedy(llm, spec["prompts"], spec["new_tokens"])))
        for batch in spec["decode_batches"]:
            conn.send((f"decode_b{batch}", _decode(llm, batch, spec)))
        if spec["prefill_tokens"]:
            conn.send(("prefill", _prefill(llm, spec)))
        conn.send(("memory", _memory(llm, spec)))
    except BaseException as exc:
        traceback.print_exc()
        conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))
    finally:
        try:
            if llm is not None:
                llm.engine.shutdown()  # stops (and joins) the worker processes
        finally:
            conn.send(("done", True))
            conn.close()


def _exit_with_parent() -> None:
    """End this process when gpu_check is gone (its watchdog exits with os._exit); the workers follow it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _replays(llm) -> int:
    graphs = llm.engine.executor.driver_worker.model_runner.cuda_graphs
    return sum(graphs.num_replays.values()) if graphs is not None else 0


def _engine_facts(llm, load_s: float) -> dict:
    runner = llm.engine.executor.driver_worker.model_runner
    graphs = runner.cuda_graphs
    facts = {"load_s": load_s, "backend": type(runner.attn_backend).__name__, "cuda_graphs": graphs is not None}
    return facts | {
        "graph_sizes": len(graphs.sizes) if graphs is not None else 0,
        "num_blocks": llm.engine.get_stats().num_blocks,
    }


def _greedy(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    from pagoda import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    before = _replays(llm)
    tokens, logprobs = [], []
    for output in llm.generate(prompts, params, use_tqdm=False):
        out = output.outputs[0]
        tokens.append(list(out.token_ids))
        logprobs.append([position[token].logprob for position, token in zip(out.logprobs, out.token_ids)])
    return {"tokens": tokens, "logprobs": logprobs, "graph_replays": _replays(llm) - before}


def _decode(llm, batch: int, spec: dict) -> dict:
    before = _replays(llm)
    d = decode_step(llm, batch, spec["decode_context"], spec["decode_steps"], spec["vocab"], None)
    result = {"batch": batch, "context": spec["decode_context"], "steps_timed": d["steps_timed"]}
    result |= {"median_step_s": d["median_step_s"], "tok_per_s": batch / d["median_step_s"]}
    return result | {"graph_replays": _replays(llm) - before}


def _prefill(llm, spec: dict) -> dict:
    from common import random_tokens
    from offline_throughput import greedy

    seconds = []
    for rep in range(spec["prefill_reps"] + 1):  # the first is a warm-up; new tokens each time (prefix cache)
        prompt = random_tokens(7000 + rep, spec["prefill_tokens"], spec["vocab"])
        begun = time.perf_counter()
        llm.generate([prompt], greedy(1), use_tqdm=False)
        seconds.append(time.perf_counter() - begun)
    return {"tokens": spec["prefill_tokens"], "reps": spec["prefill_reps"], "median_s": statistics.median(seconds[1:])}


def _memory(llm, spec: dict) -> dict:
    runner = llm.engine.executor.driver_worker.model_runner
    tensors = {id(t): t for t in itertools.chain(runner.model.parameters(), runner.model.buffers())}
    memory = {"rank0_weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    memory["kv_bytes_per_rank"] = llm.engine.get_stats().num_blocks * runner.kv_shape.bytes_per_block
    if spec["device"] == "cuda":
        memory["rank0_peak_allocated"] = torch.cuda.max_memory_allocated(0)  # since KV sizing reset it
        try:  # nvidia-smi's "used" per device (needs pynvml; creates no CUDA context)
            memory["device_used"] = [torch.cuda.device_memory_used(i) for i in range(spec["tp"])]
        except Exception as exc:
            memory["device_used_error"] = f"{type(exc).__name__}: {exc}"[:120]
    return memory


# ---- the table ---------------------------------------------------------------------------------


def compare_greedy(ref: dict, got: dict) -> dict:
    """Tokens agreeing before each prompt's first difference, and the largest logprob gap over them."""
    agree = total = same = 0
    gap, first_diffs = 0.0, []
    for t1, t2, l1, l2 in zip(ref["tokens"], got["tokens"], ref["logprobs"], got["logprobs"]):
        n = next((i for i, (a, b) in enumerate(zip(t1, t2)) if a != b), min(len(t1), len(t2)))
        agree, total, same = agree + n, total + len(t1), same + (t1 == t2)
        gap = max([gap, *(abs(a - b) for a, b in zip(l1[:n], l2[:n]))])
        first_diffs += [n] if t1 != t2 else []
    return dict(agree=agree, total=total, same=same, prompts=len(ref["tokens"]), gap=gap, first=first_diffs)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _job_rows(key: str, j: dict, ref: dict) -> list[tuple[str, ...]]:
    """One engine's rows; ``ref`` is the same model's TP=1 job (empty for TP=1 itself)."""
    rows = []
    if "engine" in j:
        e, replays = j["engine"], j.get("greedy", {}).get("graph_replays", "-")
        graphs = f"captured ({e['graph_sizes']} sizes), {replays} replays in the greedy run" if e["cuda_graphs"] else ""
        detail = f"{e['backend']}; CUDA graphs {graphs or 'NOT captured'}; {e['num_blocks']} KV blocks"
        rows.append(("tp", f"{key} engine", f"{e['load_s']:.1f} s start", detail))
    if "greedy" in j and "greedy" in ref:
        c = compare_greedy(ref["greedy"], j["greedy"])
        exact = c["agree"] == c["total"] and c["gap"] <= FP32_LOGPROB_TOL
        verdict = ("exact" if exact else "DIFFERS") if key.startswith("check") else "bf16, informational"
        detail = f"{c['same']}/{c['prompts']} prompts identical, max |dlogprob| {c['gap']:.1e} on agreeing tokens"
        detail += f"; first differences at {c['first']}" if c["first"] else ""
        rows.append(("tp", f"{key} greedy vs TP=1 ({verdict})", f"{c['agree']}/{c['total']} tok", detail))
    for d in (j[name] for name in j if name.startswith("decode_b")):
        base = ref.get(f"decode_b{d['batch']}", {}).get("tok_per_s")
        detail = f"{d['median_step_s'] * 1e3:.2f} ms/step (median of {d['steps_timed']}, context ~{d['context']})"
        detail += (f", {d['tok_per_s'] / base:.2f}x TP=1" if base else "") + f"; {d['graph_replays']} graph replays"
        rows.append(("tp", f"{key} decode batch {d['batch']}", f"{d['tok_per_s']:.0f} tok/s", detail))
    if "prefill" in j:
        p, base = j["prefill"], ref.get("prefill", {}).get("median_s")
        detail = f"generate(max_tokens=1) wall, median of {p['reps']}"
        detail += f", {base / p['median_s']:.2f}x TP=1's speed" if base else ""
        rows.append(("tp", f"{key} prefill {p['tokens']} tok", f"{p['median_s'] * 1e3:.1f} ms", detail))
    if "memory" in j:
        m = j["memory"]
        peak = _gib(m["rank0_peak_allocated"]) if "rank0_peak_allocated" in m else "-"
        detail = f"weights {_gib(m['rank0_weight_bytes'])}, KV {_gib(m['kv_bytes_per_rank'])} on each rank; the peak holds both"
        detail += f"; devices used {', '.join(map(_gib, m['device_used']))}" if "device_used" in m else ""
        rows.append(("tp", f"{key} rank-0 peak memory", peak, detail))
    for status in ("skipped", "error"):
        rows += [("tp", key, status.upper(), j[status])] if status in j else []
    if not {"done", "skipped", "error"} & j.keys():
        rows.append(("tp", key, "INCOMPLETE", "stopped by the deadline watchdog"))
    return rows


def tp_rows(r: dict) -> list[tuple[str, ...]]:
    rows = [("", "", "", "")]
    if "jobs" not in r:  # skipped, or the section failed before any engine
        status = "SKIPPED" if "skipped" in r else "ERROR"
        return [*rows, ("tp", "tensor parallel", status, r.get("skipped") or r.get("error", "not run"))]
    models = ", ".join(f"{k}: {v}" for k, v in r["models"].items())
    sizes = "/".join(map(str, r["sizes"]))
    rows.append(("tp", "sizes", sizes, f"{r['gpus']} GPUs; {models}; max_num_seqs {MAX_NUM_SEQS}"))
    rows += [("tp", "tensor parallel", "ERROR", r["error"])] if "error" in r else []
    for key, j in r["jobs"].items():
        kind, tp = key.split("/tp")
        rows += _job_rows(key, j, r["jobs"].get(f"{kind}/tp1", {}) if tp != "1" else {})
    return rows
