"""Pagoda: an LLM inference engine with a paged KV cache and continuous batching.

The public names are imported on first use, so that commands that never touch the engine (``pagoda download``,
``pagoda capabilities``, an init container's) start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagoda.version import __version__

_EXPORTS = {
    "LLM": "pagoda.entrypoints.llm",
    "CompletionOutput": "pagoda.outputs",
    "EngineArgs": "pagoda.config",
    "LLMEngine": "pagoda.engine.llm_engine",
    "Logprob": "pagoda.outputs",
    "RequestOutput": "pagoda.outputs",
    "RequestOutputKind": "pagoda.sampling_params",
    "SamplingParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.structured_output.params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:
    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.entrypoints.llm import LLM
    from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
    from pagoda.sampling_params import RequestOutputKind, SamplingParams
    from pagoda.structured_output.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
