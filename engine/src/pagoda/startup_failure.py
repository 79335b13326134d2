"""A start-up that fails says why, in one line, where Kubernetes shows it.

``report_startup_failure`` classifies the error into a reason the operator turns into the ModelDeployment's
``Degraded`` condition, and writes ``REASON: message`` to the container's termination-message file, which the
kubelet puts into the pod's ``lastState.terminated.message`` (``kubectl describe`` shows it). The file is
``$PAGODA_TERMINATION_LOG``, else ``/dev/termination-log`` when it exists (the kubelet creates it in a pod; it
is never created elsewhere).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Optional

from pagoda.model_source import DOWNLOAD_FAILED, ModelSourceError

logger = logging.getLogger(__name__)

UNSUPPORTED_SPEC = "UnsupportedSpec"
OUT_OF_MEMORY = "OutOfMemory"
MODEL_LOAD_FAILED = DOWNLOAD_FAILED  # "ModelLoadFailed": anything else that stops a model from loading
TERMINATION_LOG = "/dev/termination-log"
# The kubelet keeps at most 4096 bytes of a termination message.
_MAX_BYTES = 4096


class InsufficientMemoryError(ValueError):
    """The model does not fit: not even one max-length sequence fits in the KV cache left after the weights."""


def classify(error: BaseException) -> tuple[str, str]:
    """(reason, one-line message) for an error that stopped the engine from starting."""
    if isinstance(error, ModelSourceError):
        return error.reason, str(error)
    if isinstance(error, (InsufficientMemoryError, MemoryError)) or _is_torch_oom(error):
        return OUT_OF_MEMORY, _one_line(str(error) or type(error).__name__)
    if isinstance(error, ValueError):  # a flag, spec or model this engine cannot serve
        return UNSUPPORTED_SPEC, _one_line(str(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "OutOfDiskSpace", _one_line(str(error))
    return MODEL_LOAD_FAILED, _one_line(f"{type(error).__name__}: {error}")


def report_startup_failure(error: BaseException, path: Optional[str] = None) -> str:
    """Log the failure, write ``REASON: message`` to the termination-message file, return that line."""
    reason, message = classify(error)
    line = f"{reason}: {message}"
    target = (
        path
        or os.environ.get("PAGODA_TERMINATION_LOG")
        or (TERMINATION_LOG if os.path.exists(TERMINATION_LOG) else None)
    )
    if target:
        try:
            with open(target, "wb") as f:
                f.write(line.encode()[:_MAX_BYTES])
        except OSError as exc:  # never hide the original failure behind this one
            logger.warning("could not write the termination message to %s: %s", target, exc)
    return line


def _is_torch_oom(error: BaseException) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(error, torch.OutOfMemoryError)


def _one_line(text: str) -> str:
    return " ".join(text.split())
