"""Host-side pieces every kernel module shares: the host-wrapper pattern, and small launch helpers.

The host-wrapper pattern: a kernel and its plain-torch reference take the same parameters and are checked the same
way. Each module writes that once, as a *front*: a function with the public signature that checks the arguments
(shapes, dtypes, devices: never tensor values, which would sync with the device) and returns the checked call as
one record. :func:`host_wrapper` turns a body that takes the record (a Triton launch, or the reference) into the
public function::

    @host_wrapper(_write_call)
    def write_kv(call: _KvWrite) -> None:
        ...

This module imports no Triton: it is the bottom of the package.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
C = TypeVar("C")
R = TypeVar("R")


def host_wrapper(front: Callable[P, C]) -> Callable[[Callable[[C], R]], Callable[P, R]]:
    """Decorator: ``body(call)`` becomes a function with ``front``'s parameters that runs ``body(front(...))``.

    The result carries the body's name and docstring and ``front``'s signature (``help`` and ``inspect`` show the
    public parameters; type checkers see them through ``ParamSpec``).
    """

    def decorate(body: Callable[[C], R]) -> Callable[P, R]:
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return body(front(*args, **kwargs))

        for name in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(wrapper, name, getattr(body, name))
        returns = inspect.signature(body).return_annotation
        wrapper.__signature__ = inspect.signature(front).replace(return_annotation=returns)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (row views are fine), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for activations of ``dtype``: fp32 models get exact fp32 products; 16-bit
    models may round an fp32 operand to tf32 (10-bit mantissa), below the rounding of their own output."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (looked up once); callers pick a value for the interpreter."""
    return torch.cuda.get_device_properties(device).multi_processor_count
