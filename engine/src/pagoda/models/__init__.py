"""Model implementations and the architecture registry."""

from pagoda.models.llama import KVCacheSpec, LlamaForCausalLM
from pagoda.models.qwen3 import Qwen3ForCausalLM
from pagoda.models.registry import get_model_class, supported_architectures

__all__ = ["KVCacheSpec", "LlamaForCausalLM", "Qwen3ForCausalLM", "get_model_class", "supported_architectures"]
