"""The parts of a Hugging Face model directory's config the engine needs, parsed once.

Reads ``config.json`` (and ``generation_config.json`` when present) and resolves the
architecture-specific conventions of the supported families (Llama, Mistral, Qwen2, Qwen3) into
plain fields, so model code never has to know which config version wrote the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

# Generation defaults a checkpoint may ship that map onto sampling parameters.
_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


_TIED_BY_DEFAULT = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling as config.json names it; absent (None) for plain full-width RoPE.

    ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES` ("default" only with a partial rotary factor). The fields
    are resolved the way transformers 5 resolves them (defaults, legacy names, Phi-3's top-level
    ``original_max_position_embeddings``), so :mod:`pagoda.layers.rotary` only computes.
    """

    rope_type: str
    factor: float
    low_freq_factor: Optional[float] = None  # llama3 only
    high_freq_factor: Optional[float] = None  # llama3 only
    original_max_position_embeddings: Optional[int] = None  # llama3, yarn, longrope: the pretraining context
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that rotates (Phi-4-mini: 0.75)
    attention_factor: Optional[float] = None  # yarn, longrope: cos/sin multiplier; None: the type's default
    beta_fast: Optional[float] = None  # yarn ramp bounds (None: 32 and 1, as transformers)
    beta_slow: Optional[float] = None
    mscale: Optional[float] = None  # yarn (DeepSeek style attention factor)
    mscale_all_dim: Optional[float] = None
    truncate: bool = True  # yarn: round the correction range outward
    short_factor: Optional[tuple[float, ...]] = None  # longrope: per-frequency divisors within the original context
    long_factor: Optional[tuple[float, ...]] = None  # longrope: ... beyond it
    max_position_embeddings: Optional[int] = None  # dynamic: the length past which the base grows


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyperparameters and token/generation defaults of one checkpoint."""

    model_dir: Path
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[RopeScaling]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # bias on the attention output projection (Qwen2 has qkv bias but none here)
    mlp_bias: bool
    # Window size of each layer (None = full attention); Qwen2/Qwen3 may mix both kinds.
    layer_sliding_windows: tuple[Optional[int], ...]
    bos_token_id: Optional[int]
    eos_token_ids: frozenset[int]
    checkpoint_dtype: torch.dtype
    generation_defaults: dict[str, Any] = field(default_factory=dict, hash=False)
    # config.json as parsed: family-specific fields (MoE routing, soft-capping, attention sinks) are read from it
    # by the family's own model module, so this class stays the fields every family shares.
    raw: dict[str, Any] = field(default_factory=dict, hash=False, compare=False, repr=False)

    @property
    def sliding_window(self) -> Optional[int]:
        """The window of the sliding-window layers, or None when every layer attends fully."""
        return next((w for w in self.layer_sliding_windows if w is not None), None)

    @classmethod
    def from_model_dir(cls, model_dir: Union[str, Path]) -> ModelConfig:
        """Parse ``config.json`` (+ ``generation_config.json``) of a Hugging Face model directory."""
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist or is not a directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{str(path)!r} has no config.json; expected a Hugging Face model directory")
        raw = _read_json(config_file)
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else {}
        return _parse(path, raw, gen)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} does not contain a JSON object")
    return data


def _require(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    if value is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return value


def _parse(model_dir: Path, raw: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model class to use")
    architecture = architectures[0]
    if "hidden_size" not in raw and isinstance(raw.get("text_config"), dict):
        # Gemma 3 4B/12B/27B, Llava, Mistral 3 ...: the language model's fields sit under text_config.
        raise ValueError(
            f"{architecture} is a multimodal (image + text) checkpoint, its language model nested under "
            "text_config; Pagoda serves text-only decoders (Gemma 3: the Gemma3ForCausalLM checkpoints, 270M and 1B)"
        )
    hidden_size = int(_require(raw, "hidden_size"))
    num_heads = int(_require(raw, "num_attention_heads"))
    num_layers = int(_require(raw, "num_hidden_layers"))
    qkv_bias, o_proj_bias, mlp_bias = _biases(architecture, raw)
    rope_theta, rope_scaling = parse_rope(raw)
    return ModelConfig(
        model_dir=model_dir,
        architecture=architecture,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        intermediate_size=int(_require(raw, "intermediate_size")),
        hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act", "silu")),  # Gemma: hidden_activation
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        # transformers' Gemma configs default to tied embeddings (the Hub's often omit the key); the others do not
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", architecture in _TIED_BY_DEFAULT)),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        layer_sliding_windows=_layer_sliding_windows(architecture, raw, num_layers),
        bos_token_id=raw["bos_token_id"] if raw.get("bos_token_id") is not None else gen.get("bos_token_id"),
        eos_token_ids=frozenset(_token_ids(raw.get("eos_token_id")) | _token_ids(gen.get("eos_token_id"))),
        checkpoint_dtype=_checkpoint_dtype(raw),
        generation_defaults={k: gen[k] for k in _GENERATION_DEFAULT_KEYS if gen.get(k) is not None},
        raw=raw,
    )


def _biases(architecture: str, raw: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(qkv_bias, o_proj_bias, mlp_bias) following each transformers implementation."""
    if architecture == "Qwen2ForCausalLM":
        return True, False, False  # hard-coded in transformers' Qwen2Attention, not configurable
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return False, False, False
    if architecture == "Qwen2MoeForCausalLM":
        return bool(raw.get("qkv_bias", True)), False, False  # Qwen2MoeConfig.qkv_bias; o/MLP never biased
    attention_bias = bool(raw.get("attention_bias", False))
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        return attention_bias, attention_bias, False
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return attention_bias, attention_bias, False  # Gemma's MLP has no bias switch
    return attention_bias, attention_bias, bool(raw.get("mlp_bias", False))


def _layer_sliding_windows(architecture: str, raw: dict[str, Any], num_layers: int) -> tuple[Optional[int], ...]:
    window = raw.get("sliding_window")
    if architecture == "Qwen3MoeForCausalLM":
        # transformers' Qwen3-MoE windows every layer, and only under use_sliding_window.
        return (int(window) if window and raw.get("use_sliding_window", False) else None,) * num_layers
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        # transformers' Mistral and Phi-3 apply the window to every layer and ignore layer_types.
        return (int(window) if window else None,) * num_layers
    if architecture == "Qwen2MoeForCausalLM" and raw.get("layer_types") is None:
        # Qwen2MoeConfig's default layer_types: every other layer below max_window_layers slides.
        if not raw.get("use_sliding_window", False) or not window:
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", 28))
        return tuple(int(window) if (i + 1) % 2 and i < first else None for i in range(num_layers))
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        # transformers drops the window unless use_sliding_window; layers from max_window_layers on
        # slide (unless layer_types lists the kind of each layer explicitly).
        if not raw.get("use_sliding_window", False) or not window:
            return (None,) * num_layers
        layer_types = raw.get("layer_types")
        if layer_types is None:
            first = int(raw.get("max_window_layers", 28))
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return _gemma_sliding_windows(architecture, raw, num_layers)
    if architecture == "GptOssForCausalLM":
        # GptOssConfig: layer_types as listed, else even layers slide and odd ones attend fully.
        kinds = raw.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
        if len(kinds) != num_layers:
            raise ValueError(f"config.json layer_types has {len(kinds)} entries for {num_layers} layers")
        return tuple(int(window) if window and t == "sliding_attention" else None for t in kinds)
    return (None,) * num_layers


def _gemma_sliding_windows(architecture: str, raw: dict[str, Any], num_layers: int) -> tuple[Optional[int], ...]:
    window = raw.get("sliding_window", 4096)  # the configs' default when absent
    kinds = gemma_layer_types(architecture, raw, num_layers)
    return tuple(int(window) if window and kind == "sliding_attention" else None for kind in kinds)


def gemma_layer_types(architecture: str, raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's kind ("sliding_attention" / "full_attention") as Gemma2Config / Gemma3TextConfig resolve it.

    Without ``layer_types`` Gemma 2 alternates (even layers slide) and Gemma 3 slides but for every
    ``sliding_window_pattern``-th layer (default 6). Raises ValueError when the list has the wrong length.
    """
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = 2 if architecture == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers")
    return [str(kind) for kind in layer_types]


def parse_rope(raw: dict[str, Any]) -> tuple[float, Optional[RopeScaling]]:
    """RoPE base and scaling from transformers 5 ``rope_parameters`` or legacy ``rope_theta``/``rope_scaling``."""
    # Same precedence as transformers: a legacy rope_scaling dict wins over rope_parameters.
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if raw.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config renames Phi-3's early names for LongRoPE
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    # The dict's own value wins over a top-level one (Phi-4-mini writes it top-level).
    partial = float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], config.json has {partial}")
    if rope_type == "default":
        return theta, None if partial == 1.0 else RopeScaling("default", 1.0, partial_rotary_factor=partial)
    try:
        return theta, _rope_scaling(rope_type, params, raw, partial)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{rope_type} RoPE scaling in config.json is incomplete: missing or invalid {exc}") from exc


def _rope_scaling(rope_type: str, params: dict[str, Any], raw: dict[str, Any], partial: float) -> RopeScaling:
    max_positions = int(raw.get("max_position_embeddings") or 2048)
    original = _original_max_positions(params, raw, max_positions)
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_positions / original  # transformers' default for these two (Phi-3 writes no factor)
    if factor is None:
        raise ValueError(f"RoPE type {rope_type!r} needs a 'factor' in config.json")
    factor = float(factor)
    if rope_type == "linear":
        return RopeScaling("linear", factor, partial_rotary_factor=partial)
    if rope_type == "dynamic":
        return RopeScaling("dynamic", factor, partial_rotary_factor=partial, max_position_embeddings=max_positions)
    if rope_type == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        return RopeScaling("llama3", factor, low, high, original, partial_rotary_factor=partial)
    attention = params.get("attention_factor")
    attention = None if attention is None else float(attention)
    if rope_type == "yarn":
        return RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=original,
            partial_rotary_factor=partial,
            attention_factor=attention,
            beta_fast=_optional_float(params.get("beta_fast")),
            beta_slow=_optional_float(params.get("beta_slow")),
            mscale=_optional_float(params.get("mscale")),
            mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
            truncate=bool(params.get("truncate", True)),
        )
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        partial_rotary_factor=partial,
        attention_factor=attention,
        short_factor=tuple(float(x) for x in params["short_factor"]),
        long_factor=tuple(float(x) for x in params["long_factor"]),
        max_position_embeddings=max_positions,
    )


def _original_max_positions(params: dict[str, Any], raw: dict[str, Any], max_positions: int) -> int:
    """The pretraining context of llama3/yarn/longrope, resolved as transformers 5 does."""
    # A top-level field wins over the rope dict's; Phi3Config defaults it to 4096 when config.json has none.
    top_level = raw.get("original_max_position_embeddings")
    if top_level is None and raw.get("model_type") == "phi3":
        top_level = 4096
    original = top_level if top_level is not None else params.get("original_max_position_embeddings")
    return int(original) if original is not None else max_positions


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is None:
        return torch.float32  # what transformers assumes when a config names no dtype
    key = str(name).removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"checkpoint dtype {name!r} in config.json is not supported (use float32/bfloat16/float16)")
    return _DTYPE_NAMES[key]


def resolve_dtype(requested: str, config: ModelConfig, device: Union[str, torch.device]) -> torch.dtype:
    """Turn a user dtype string into a torch dtype.

    "auto" means the checkpoint's dtype (a float32 checkpoint stays float32). bfloat16 on a GPU
    without native support falls back to float16 under "auto" and is an error when asked for.
    """
    key = requested.strip().lower()
    bf16_ok = _supports_bfloat16(torch.device(device))
    if key == "auto":
        dtype = config.checkpoint_dtype
        return torch.float16 if dtype == torch.bfloat16 and not bf16_ok else dtype
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {requested!r}; choose one of: auto, {', '.join(_DTYPE_NAMES)}")
    dtype = _DTYPE_NAMES[key]
    if dtype == torch.bfloat16 and not bf16_ok:
        raise ValueError(f"bfloat16 is not supported on {device}; use float16 or float32")
    return dtype


def _supports_bfloat16(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)
