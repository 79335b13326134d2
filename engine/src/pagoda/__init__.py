"""Pagoda: an LLM inference engine with a paged KV cache and continuous batching."""

from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.llm import LLM
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
