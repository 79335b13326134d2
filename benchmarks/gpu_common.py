"""Pieces every GPU benchmark shares: the deadline, the gpu tests, CUDA-event timing (inside a CUDA graph where
the function allows it), copy bandwidth, and what a kernel case is (shapes, sizes, variants, the bytes it moves).
The cases themselves are in gpu_kernels.py and gpu_lora.py.
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from common import log  # noqa: E402 (the benchmarks folder is not a package)

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPH_MIN_CALLS = 8  # calls captured per CUDA-graph replay, so one replay is long next to event resolution
COLD_BYTES = 256 * 2**20  # inputs are rotated over copies totalling this much, so L2 (50 MB on H200) stays cold


class Budget:
    """A wall-clock deadline shared by every section."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, need_s: float, what: str) -> bool:
        """Whether ``need_s`` seconds remain; logs the skip when not."""
        if self.left() >= need_s:
            return True
        log(f"SKIP {what}: needs ~{need_s:.0f} s, {max(self.left(), 0):.0f} s left before the deadline")
        return False


def run_pytest(timeout_s: float) -> dict:
    """``pytest -m gpu tests/kernels tests/engine -q`` in a subprocess; counts from its summary line."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/kernels", "tests/engine", "-q", "-p", "no:cacheprovider"]
    log(f"pytest: {' '.join(cmd[2:])} (at most {timeout_s:.0f} s)")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
        output, returncode, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as exc:  # its captured output is bytes whatever text= says
        output = b"".join(x for x in (exc.stdout, exc.stderr) if x).decode(errors="replace")
        returncode, timed_out = None, True
    lines = output.splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|deselected)", line)), "")
    counts = {word.rstrip("s"): int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    result = {"command": " ".join(cmd[2:]), "seconds": time.monotonic() - start, "timed_out": timed_out}
    result |= {"returncode": returncode, "counts": counts, "failed_tests": failed[:30]}
    result["tail"] = lines[-25:] if failed or timed_out or returncode not in (0, 5) else []
    log(f"pytest: {summary.strip('= ') or 'no summary'} (rc {returncode})")
    return result


ArgSet = tuple


def _seconds(run: Callable[[], object], device: torch.device) -> float:
    """Wall time of ``run()`` on the device: CUDA events on a GPU, the host clock on CPU."""
    if device.type != "cuda":
        begin = time.perf_counter()
        run()
        return time.perf_counter() - begin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _graph(fn: Callable, calls: list[ArgSet]) -> Optional[torch.cuda.CUDAGraph]:
    """``calls`` captured in one CUDA graph, or None when the function cannot be captured. Only a function
    that makes no device->host sync (.item(), .tolist()) is tried, so a failed capture cannot break the context."""
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.set_sync_debug_mode("error")  # raises on a sync
        fn(*calls[0])
        torch.cuda.set_sync_debug_mode("default")
        with torch.cuda.graph(graph):
            for args in calls:
                fn(*args)
    except RuntimeError as exc:
        log(f"    no CUDA graph ({str(exc).splitlines()[0][:80]}); timing eagerly")
        torch.cuda.synchronize()
        return None
    finally:
        torch.cuda.set_sync_debug_mode("default")  # whatever the function raised
    graph.replay()
    return graph


def time_call(fn: Callable, arg_sets: list[ArgSet], device: torch.device, warmup: int, reps: int) -> tuple[float, str]:
    """(median seconds per call, "graph" or "eager"). Warm-up runs first (Triton compiles there).

    On CUDA, at least GRAPH_MIN_CALLS calls are replayed from one CUDA graph when the function
    allows it, as the engine runs them, so Python launch overhead does not hide the kernel time;
    otherwise they are timed eagerly. ``arg_sets`` are cycled through, to keep the caches cold.
    """
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    calls = arg_sets * math.ceil(GRAPH_MIN_CALLS / len(arg_sets)) if device.type == "cuda" else arg_sets
    graph = _graph(fn, calls) if device.type == "cuda" else None
    run = graph.replay if graph is not None else lambda: [fn(*args) for args in calls]
    seconds = statistics.median(_seconds(run, device) for _ in range(reps)) / len(calls)
    return seconds, "graph" if graph is not None else "eager"


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int, reps: int) -> dict:
    """Device-to-device copy of one large buffer; GB/s counts the read and the write."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, method = time_call(lambda: dst.copy_(src), [()], device, warmup, reps)
    return {"bytes": 2 * nbytes, "seconds": seconds, "gb_per_s": 2 * nbytes / seconds / 1e9, "method": method}


@dataclass(frozen=True, slots=True)
class Shape:
    """The model dimensions a kernel case takes its sizes from."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


QWEN3_KERNEL_SHAPE = Shape("qwen3", 16, 8, 128, 1024, 3072)
LLAMA8B_KERNEL_SHAPE = Shape("llama8b", 32, 8, 128, 4096, 14336)
SMOKE_KERNEL_SHAPES = (Shape("tiny-gqa", 4, 2, 16, 32, 48), Shape("tiny-mqa", 4, 1, 16, 32, 48))


@dataclass(frozen=True, slots=True)
class Sizes:
    """The workload sizes of the issue (or tiny ones for --smoke)."""

    decode_batch: int = 64
    decode_context: int = 2048
    extend_requests: int = 8
    extend_chunk: int = 512
    extend_prefix: int = 1536
    tokens: int = 2048  # write_kv, norms, rotary, activation
    block_size: int = 16


SMOKE_SIZES = Sizes(decode_batch=2, decode_context=40, extend_requests=2, extend_chunk=8, extend_prefix=24, tokens=16)


@dataclass(slots=True)
class KernelCase:
    """One kernel at one shape: variants (name -> function and input factory) and the bytes moved."""

    name: str
    label: str
    bytes_moved: int
    flops: int = 0
    variants: dict[str, tuple[Callable, Callable[[], ArgSet]]] = field(default_factory=dict)
    input_bytes: int = 0  # one input set, to size the rotation that keeps L2 cold


def randn(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A standard-normal tensor of ``shape`` (the kernel cases' inputs)."""
    return torch.randn(shape, dtype=dtype, device=device)
