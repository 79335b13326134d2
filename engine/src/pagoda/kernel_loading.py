"""Finding the Triton kernels of ``pagoda_kernels`` without importing Triton on machines that never use it.

The fused layers (RMSNorm, rotary, SiluAndMul) look their CUDA kernels up through :func:`load_kernel`; the Triton
attention backend checks with :func:`check_triton_usable` that it can run. CPU-only installs have neither package,
and nothing here imports them unless a kernel is actually asked for.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any, Optional

import torch


def triton_available() -> bool:
    """Whether Triton and the kernels package can be imported (checked without importing them)."""
    return find_spec("triton") is not None and find_spec("pagoda_kernels") is not None


@functools.cache
def load_kernel(module: str, name: str) -> Optional[Callable[..., Any]]:
    """``pagoda_kernels.<module>.<name>``, or None when Triton is not installed (looked up once).

    The fused layers (RMSNorm, rotary, SiluAndMul) call this on their CUDA path only, so CPU runs
    never import Triton.
    """
    if not triton_available():
        return None
    return getattr(importlib.import_module(f"pagoda_kernels.{module}"), name)


def check_triton_usable(device: torch.device) -> None:
    """Raise ValueError when the Triton backend cannot run on ``device``.

    On CPU the kernels only run in Triton's interpreter, which is slow and meant for tests, so it
    must be asked for explicitly with ``TRITON_INTERPRET=1`` (set before the kernels are imported).
    """
    if not triton_available():
        raise ValueError(
            "attention_backend 'triton' needs the triton and pagoda-kernels packages; install them "
            "(pip install ./kernels) or use attention_backend 'torch'"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend 'triton' needs a CUDA device; on CPU use 'torch' (or 'auto'). "
            "Running the kernels on CPU in Triton's interpreter (TRITON_INTERPRET=1) is for tests only"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention_backend 'triton' runs on CUDA devices, not {device.type!r}")
