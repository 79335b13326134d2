"""Native CPU kernels, compiled on first use with the machine's C++ compiler.

The sources ship inside the package; :func:`cpu_ops` builds them once per machine (about 30 s,
cached under ``$PAGODA_CACHE_DIR`` or ``~/.cache/pagoda``) and registers them as
``torch.ops.pagoda_cpu.*``. When no compiler is available the callers fall back to stock PyTorch
ops, which are slower but give the same results up to rounding.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = (
    "packed_linear.cpp",
    "packed_linear_int8.cpp",
    "packed_linear_int4.cpp",
    "packed_linear_fp8.cpp",
    "fused_ops.cpp",
    "paged_attention.cpp",
    "lora.cpp",
)


def _build_dir() -> Path:
    """One build per torch version and CPU: the kernels are compiled with -march=native, and a cache directory on a
    volume shared by nodes with different CPUs must never hand one CPU's build to another (SIGILL)."""
    root = Path(os.environ.get("PAGODA_CACHE_DIR") or Path.home() / ".cache" / "pagoda")
    path = root / "cpu_ops" / f"torch-{torch.__version__}" / _cpu_key()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_key() -> str:
    """A short hash of the CPU's model name and feature flags (what -march=native compiles for)."""
    identity = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        identity += "".join(sorted(set(lines)))
    except OSError:
        identity += platform.processor()
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


@functools.cache
def cpu_ops() -> bool:
    """Build (once) and load the native CPU ops; False (with a warning) when that is not possible."""
    if os.environ.get("PAGODA_DISABLE_CPU_OPS"):
        return False
    from torch.utils.cpp_extension import load

    here = Path(__file__).resolve().parent
    start = time.monotonic()
    try:
        build_dir = _build_dir()
        with _exclusive_build(build_dir):
            load(
                name="pagoda_cpu_ops",
                sources=[str(here / name) for name in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        logger.warning("native CPU kernels unavailable (%s); using slower stock PyTorch ops", exc)
        return False
    logger.info("native CPU kernels ready in %.1f s", time.monotonic() - start)
    return True


@contextlib.contextmanager
def _exclusive_build(build_dir: Path) -> Iterator[None]:
    """torch's build lock is a plain file (``lock``, its FileBaton): a process killed mid-build (OOM, a pod deleted
    during start-up) leaves it behind, and every later start then waits for it forever. An flock is released by the
    kernel when its holder dies, so while this process holds one, any ``lock`` file left in the directory is stale."""
    with open(build_dir / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing a stale build lock left by a process that died while compiling: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def use_fused_ops(x: torch.Tensor) -> bool:
    """Whether the native fused elementwise ops serve this tensor.

    Only for 16-bit activations: there they round exactly like the unfused PyTorch ops. In float32
    a fused float32 sum or ``exp`` may differ in the last bit, and float32 runs are the ones tests
    hold bit-exact to transformers.
    """
    return x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and cpu_ops()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [rows, vocab] logits: the same indices (first on ties, NaN wins).

    float32 CPU logits take the native vectorised op: ATen's argmax scanned [32, 151936] logits
    in ~2.2 ms of a 130 ms decode step, the native op in ~0.3 ms.
    """
    native = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
    if native and logits.shape[1] > 0 and cpu_ops():
        return torch.ops.pagoda_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Every step allocates its activations afresh (a [32, 6144] bf16 GEMM output is 384 KB, a batch's float32
# logits tens of MB). By default glibc serves blocks over 128 KB-32 MB with mmap and returns freed heap
# tops to the kernel, so each step page-faults all of them in again: measured 49 of 194 ms per step at 32
# decodes of the Qwen3-0.6B shape on a 2-core VM. Keeping blocks up to 64 MB on the heap and freed memory
# up to 512 MB in the process makes those allocations reuse warm pages.
MALLOC_MMAP_THRESHOLD = 64 << 20
MALLOC_TRIM_THRESHOLD = 512 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc so per-step tensors reuse pages instead of faulting them in (see above).

    Process-wide and idempotent; a no-op (False) without glibc or with ``PAGODA_DISABLE_MALLOC_TUNING``
    set. Called by the engine when it runs on the CPU.
    """
    if os.environ.get("PAGODA_DISABLE_MALLOC_TUNING"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError on a non-glibc C library
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    applied = (
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1
    )
    logger.debug("glibc malloc tuning %s", "applied" if applied else "refused")
    return applied
