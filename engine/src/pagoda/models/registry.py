"""Which model class implements each Hugging Face ``architectures`` name."""

from __future__ import annotations

from torch import nn

from pagoda.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagoda.models.gpt_oss import GptOssForCausalLM
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.mixtral import MixtralForCausalLM
from pagoda.models.phi3 import Phi3ForCausalLM
from pagoda.models.qwen2_moe import Qwen2MoeForCausalLM
from pagoda.models.qwen3 import Qwen3ForCausalLM
from pagoda.models.qwen3_moe import Qwen3MoeForCausalLM

# Mistral and Qwen2 are Llama with config switches (sliding window, q/k/v bias), so they share the class.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names (as in config.json) that :func:`get_model_class` accepts."""
    return sorted(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for ``architecture``; ValueError naming the supported ones otherwise."""
    cls = _MODEL_CLASSES.get(architecture)
    if cls is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return cls
