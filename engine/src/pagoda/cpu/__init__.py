"""Native CPU kernels, compiled on first use with the machine's C++ compiler.

The sources ship inside the package; :func:`cpu_ops` builds them once per machine (about 10 s,
cached under ``$PAGODA_CACHE_DIR`` or ``~/.cache/pagoda``) and registers them as
``torch.ops.pagoda_cpu.*``. When no compiler is available the callers fall back to stock PyTorch
ops, which are slower but give the same results up to rounding.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = ("packed_linear.cpp", "fused_ops.cpp", "paged_attention.cpp")


def _build_dir() -> Path:
    root = Path(os.environ.get("PAGODA_CACHE_DIR") or Path.home() / ".cache" / "pagoda")
    path = root / "cpu_ops" / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def cpu_ops() -> bool:
    """Build (once) and load the native CPU ops; False (with a warning) when that is not possible."""
    if os.environ.get("PAGODA_DISABLE_CPU_OPS"):
        return False
    from torch.utils.cpp_extension import load

    here = Path(__file__).resolve().parent
    start = time.monotonic()
    try:
        load(
            name="pagoda_cpu_ops",
            sources=[str(here / name) for name in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_dir()),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        logger.warning("native CPU kernels unavailable (%s); using slower stock PyTorch ops", exc)
        return False
    logger.info("native CPU kernels ready in %.1f s", time.monotonic() - start)
    return True


_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def use_fused_ops(x: torch.Tensor) -> bool:
    """Whether the native fused elementwise ops serve this tensor.

    Only for 16-bit activations: there they round exactly like the unfused PyTorch ops. In float32
    a fused float32 sum or ``exp`` may differ in the last bit, and float32 runs are the ones tests
    hold bit-exact to transformers.
    """
    return x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and cpu_ops()
