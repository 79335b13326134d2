"""The processes of ``tp_compare.py``: an engine host (one per tensor-parallel size, holding an LLM for the whole
run) and the two peers of the communication micro-benchmarks; plus the tiny checkpoint of ``--quick``, the
CPU flags and the memory read-outs.

Everything here is importable by spawned processes (multiprocessing's spawn re-imports the main module, so
nothing runs at import time).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import statistics
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

import torch

from common import QWEN3_SHAPE, ensure_qwen3_shape_checkpoint

# --quick: the Qwen3 architecture at toy sizes (loads in a second; every code path of the full run).
QUICK_SHAPE = dict(
    QWEN3_SHAPE,
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)


def ensure_quick_checkpoint(model_dir: Path) -> Path:
    """A bf16 random-weight checkpoint of QUICK_SHAPE (built once)."""
    return ensure_qwen3_shape_checkpoint(model_dir, QUICK_SHAPE)


def cpu_flags() -> str:
    """The vector-ISA flags that decide the CPU kernels (present ones, then the absent ones marked 'no')."""
    from pagoda.cpu.cpu_features import isa_flags

    flags = isa_flags()
    return " ".join([f for f, on in flags.items() if on] + [f"no {f}" for f, on in flags.items() if not on])


def proc_memory(pid: Any = "self") -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (peak resident) of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024  # kB
    return out


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the weights this rank holds: the parameters (the embedding, norms; a linear layer's plain weight
    is emptied once a CPU kernel repacks it) and the kernels' packed copies (``Linear.kernel``). A tied lm_head's
    packed copy counts on top of the embedding it shares with: both stay in memory."""
    params = {p.data_ptr() for p in model.parameters() if p.numel()}
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = 0
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if kernel is None or not dataclasses.is_dataclass(kernel):
            continue
        for field in dataclasses.fields(kernel):
            value = getattr(kernel, field.name)
            if not isinstance(value, torch.Tensor):
                continue
            try:
                shared = value.data_ptr() in params  # e.g. a bias the kernel keeps as the parameter itself
            except RuntimeError:  # opaque (mkldnn) tensors have no data pointer
                shared = False
            packed += 0 if shared else value.numel() * value.element_size()
    return {"params": plain, "packed": packed}


# ---- the engine host ----------------------------------------------------------------------------------------


class _Probe:
    """Rank 0's time inside the collectives and the plan broadcast (patched around the real methods)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.last_plan: Any = None

    def install(self) -> None:
        from pagoda.distributed.parallel import TensorParallel
        from pagoda.executor.worker_group import WorkerGroup

        for cls, name in (
            (TensorParallel, "all_reduce"),
            (TensorParallel, "gather_to_first"),
            (WorkerGroup, "broadcast"),
        ):
            setattr(cls, name, self._timed(getattr(cls, name), name))

    def _timed(self, method, key: str):
        def timed(obj, *args):
            if key == "broadcast" and args[0] == "run_forward":
                self.last_plan = args[1][0]  # the ForwardStep, for the transport micro-benchmark
            start = time.perf_counter()
            try:
                return method(obj, *args)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
                self.calls[key] = self.calls.get(key, 0) + 1

        return timed

    def take(self) -> dict[str, float]:
        """Seconds and calls since the last take; resets."""
        out = {f"{k}_s": v for k, v in self.seconds.items()} | {f"{k}_calls": v for k, v in self.calls.items()}
        self.seconds, self.calls = {}, {}
        return out


def engine_host(conn: Connection, settings: dict) -> None:
    """Process entry point: load ``LLM(tensor_parallel_size=settings["tp"])``, report its memory, then run the
    workloads the driver names on ``conn`` until it says stop."""
    try:
        _serve_host(conn, settings)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _serve_host(conn: Connection, settings: dict) -> None:
    tp = settings["tp"]
    if tp == 1:  # one process with every core; TP=2 gives each rank its share itself (cpu_threads_per_rank)
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    from pagoda import LLM

    probe = _Probe()
    if tp > 1:
        probe.install()
    before = proc_memory()
    llm = LLM(model=settings["model"], tensor_parallel_size=tp, **settings["engine"])
    engine, runner = llm.engine, llm.engine.executor.driver_worker.model_runner
    workers = getattr(engine.executor, "workers", None)  # the worker processes of ranks 1..N-1
    try:
        info = {
            "threads": torch.get_num_threads(),
            "worker_threads": workers.spec.num_threads if workers else None,
            "kernels": dict(runner.linear_kernels),
            "weights": weight_bytes(runner.model),
            "kv_bytes": sum(c.numel() * c.element_size() for c in runner.kv_caches),
            "rank0_before_load": before,
        }
        conn.send(("ready", info | {"memory": _memory(workers)}))
        runs = _Runs(engine, probe, settings)
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            if command[0] == "memory":
                conn.send(("ok", _memory(workers)))
            else:
                conn.send(("ok", runs.run(*command[1:])))
    finally:
        engine.shutdown()


def _memory(workers) -> dict[str, dict[str, int]]:
    out = {"rank 0": proc_memory()}
    for rank, process in enumerate(workers.processes if workers else [], start=1):
        out[f"rank {rank}"] = proc_memory(process.pid)
    return out


class _Runs:
    """One workload at a time on the host's engine; decode timed over the steps in which every request decodes."""

    def __init__(self, engine, probe: _Probe, settings: dict) -> None:
        self.engine, self.probe, self.settings = engine, probe, settings
        self.ids = 0

    def run(self, kind: str, prompts: list[list[int]], max_tokens: int) -> dict:
        from pagoda import SamplingParams

        engine = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.probe.take()
        start = time.perf_counter()
        for prompt in prompts:
            self.ids += 1
            engine.add_request(f"r{self.ids}", prompt, params)
        step_seconds: list[float] = []
        probed: list[dict[str, float]] = []
        tokens: dict[str, list[int]] = {}
        plan = None
        while engine.has_unfinished_requests():
            running = engine.scheduler.running
            timed = kind == "prefill" or (
                len(running) == len(prompts) and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
            )
            step_start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - step_start
            if timed:
                step_seconds.append(elapsed)
                probed.append(self.probe.take())
                plan = self.probe.last_plan
            else:
                self.probe.take()
            tokens.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
        total = time.perf_counter() - start
        steps = max(len(step_seconds), 1)
        keys = {k for p in probed for k in p}
        result = {
            "steps": len(step_seconds),
            "step_s_median": statistics.median(step_seconds) if step_seconds else None,
            "decode_tok_s": len(prompts) * len(step_seconds) / sum(step_seconds) if step_seconds else None,
            "ttft_s": total,  # prefill: one prompt, max_tokens=1
            "per_step": {k: sum(p.get(k, 0) for p in probed) / steps for k in keys},
            "tokens": [tokens[f"r{i}"] for i in range(self.ids - len(prompts) + 1, self.ids + 1)],
        }
        if plan is not None:
            result["plan"] = plan
        return result


# ---- the communication micro-benchmarks ---------------------------------------------------------------------


def comm_peer(rank: int, init_method: str, pipe: Connection, out: Optional[Connection], job: dict) -> None:
    """Process entry point of one of two ranks (1 torch thread each): the step-plan transports, then the model's
    collectives at the model's tensor sizes. Rank 0 sends the results on ``out``."""
    import dataclasses

    from pagoda.distributed.parallel import init_tensor_parallel
    from pagoda.distributed.shm_comm import ShmCommunicator

    torch.set_num_threads(1)
    # rank 0 creates the segment before joining, so it exists once rank 1 has joined too (as in the engine)
    shm = ShmCommunicator(job["shm_path"], 0, 2, 300.0) if rank == 0 else None
    tp = init_tensor_parallel(rank, 2, init_method, torch.device("cpu"), 300.0)
    if shm is None:
        shm = ShmCommunicator(job["shm_path"], 1, 2, 300.0)
    import torch.distributed as dist

    dist.barrier(group=tp.cpu_group)
    if rank == 0:
        shm.unlink()
    try:
        collectives = {"shm": _collectives(dataclasses.replace(tp, shm=shm), job), "gloo": _collectives(tp, job)}
        results = {"transport": _transport(tp, pipe, job), "collectives": collectives}
        if out is not None:
            out.send(results)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _transport(tp, pipe: Connection, job: dict) -> dict:
    """One-way latency of a pickled ForwardStep: the engine's pipe (pickle, send_bytes / recv_bytes, unpickle)
    against gloo's broadcast_object_list (TensorParallel.broadcast_object).

    Ping-pong, halved: rank 0 sends the message, rank 1 receives and unpickles it and sends the same message back
    the same way (the pipe: re-pickled, send_bytes; gloo: a broadcast from rank 1), and rank 0 stops its clock once
    it has unpickled the echo. Both directions do the same work, so half the round trip is one send: serialise,
    copy, wake the receiver, deserialise, with no clock shared between processes. The two transports alternate
    iteration by iteration, so a slow spell of the machine lands on both.
    """
    import torch.distributed as dist

    results = {}
    for name, plan in job["plans"].items():
        message = ("run_forward", (plan,))  # what WorkerGroup.broadcast pickles
        pipe_s, gloo_s = [], []
        for i in range(job["transport_iters"] + 20):  # the first 20: warm-up
            start = time.perf_counter()
            if tp.rank == 0:
                pipe.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
                pickle.loads(pipe.recv_bytes())
            else:
                echo = pickle.loads(pipe.recv_bytes())
                pipe.send_bytes(pickle.dumps(echo, protocol=pickle.HIGHEST_PROTOCOL))
            middle = time.perf_counter()
            box = [tp.broadcast_object(message if tp.rank == 0 else None)]
            dist.broadcast_object_list(box, src=1, group=tp.cpu_group)  # the echo
            end = time.perf_counter()
            if i >= 20:
                pipe_s.append((middle - start) / 2)
                gloo_s.append((end - middle) / 2)
        results[name] = {
            "bytes": len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)),
            "pipe_us": statistics.median(pipe_s) * 1e6,
            "gloo_us": statistics.median(gloo_s) * 1e6,
        }
    return results


def _collectives(tp, job: dict) -> dict:
    """Microseconds per call of the model's own collectives (TensorParallel.all_reduce of bf16 [n, hidden],
    gather_to_first of fp32 [n, vocab_shard]): rounds of back-to-back calls between barriers, timed on rank 0,
    median over rounds. The tensors are zeros, so repeated in-place sums stay finite (and never denormal)."""
    import torch.distributed as dist

    results = {}
    cases = [("all_reduce", n, job["hidden"], torch.bfloat16) for n in job["all_reduce_rows"]]
    cases += [("gather", n, job["vocab_shard"], torch.float32) for n in job["gather_rows"]]
    for op, rows, width, dtype in cases:
        tensor = torch.zeros(rows, width, dtype=dtype)
        call = tp.all_reduce if op == "all_reduce" else tp.gather_to_first
        per_round = max(2, job["collective_calls"] // max(1, rows * width * tensor.element_size() // 2**20))
        samples = []
        for r in range(job["collective_rounds"] + 2):  # the first 2: warm-up
            dist.barrier(group=tp.cpu_group)
            start = time.perf_counter()
            for _ in range(per_round):
                call(tensor)
            if r >= 2:
                samples.append((time.perf_counter() - start) / per_round)
        results[f"{op} {rows}"] = statistics.median(samples) * 1e6
    return results
