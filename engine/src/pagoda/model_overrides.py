"""vLLM's ``--hf-overrides`` and ``--override-generation-config``: JSON objects merged over a checkpoint's
``config.json`` and ``generation_config.json``.

Only the keys the engine can honour are taken: ``config.json`` keys that change how the model computes without
changing its tensors' shapes (a different hidden size would not match the weights), and the generation defaults
that become sampling parameters. Any other key is refused at start, named, instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

# config.json keys an override may set: context length, RoPE, norm epsilon, special tokens, sliding windows, dtype.
HF_OVERRIDE_KEYS = (
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "torch_dtype",
    "dtype",
)
# generation_config.json keys that become a request's defaults (the OpenAI server's and LLM's).
GENERATION_OVERRIDE_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def json_object_flag(flag: str):
    """The ``parse`` of a flag given as a JSON object (vLLM's form); None when it is not set."""

    def parse(value: Optional[str]) -> Optional[dict[str, Any]]:
        if value is None:
            return None
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: cannot parse {value!r} as JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{flag} must be a JSON object, got {value!r}")
        return parsed

    return parse


def check_overrides(hf_overrides: Optional[Mapping[str, Any]], generation: Optional[Mapping[str, Any]]) -> None:
    """ValueError naming the keys of either override that the engine cannot honour."""
    _check_keys("--hf-overrides", hf_overrides, HF_OVERRIDE_KEYS, "they would not match the checkpoint's weights")
    _check_keys(
        "--override-generation-config", generation, GENERATION_OVERRIDE_KEYS, "they are not sampling defaults here"
    )


def _check_keys(flag: str, values: Optional[Mapping[str, Any]], allowed: tuple[str, ...], why: str) -> None:
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise ValueError(f"{flag} must be a JSON object, got {values!r}")
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValueError(
            f"{flag}: cannot honour {', '.join(map(repr, unknown))} ({why}); accepted keys: {', '.join(allowed)}"
        )


def apply_overrides(
    config,
    hf_overrides: Optional[Mapping[str, Any]],
    generation: Optional[Mapping[str, Any]],
    generation_config: str = "auto",
):
    """``config`` (a :class:`~pagoda.model_config.ModelConfig`) with the overrides merged in: ``config.json`` parsed
    again with ``hf_overrides`` over it (and ``generation_config.json`` read from the ``generation_config`` folder
    when it names one: vLLM's ``--generation-config FOLDER``), the generation defaults updated with ``generation``."""
    from pagoda import model_config

    check_overrides(hf_overrides, generation)
    gen_folder = Path(generation_config) if generation_config not in ("auto", "vllm") else None
    if hf_overrides or gen_folder is not None:
        raw = model_config._read_json(config.model_dir / "config.json")
        gen_file = (gen_folder or config.model_dir) / "generation_config.json"
        if gen_folder is not None and not gen_file.is_file():
            raise ValueError(f"--generation-config {generation_config}: the folder has no generation_config.json")
        gen = model_config._read_json(gen_file) if gen_file.is_file() else {}
        config = model_config._parse(config.model_dir, _merged(raw, hf_overrides or {}), gen)
    if generation:
        config = dataclasses.replace(config, generation_defaults={**config.generation_defaults, **generation})
    return config


def _merged(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with ``overrides`` over it; a ``rope_theta`` also goes into the ``rope_parameters`` (transformers 5
    keeps it there, and it wins over the top-level key) unless the overrides set those too."""
    merged = {**raw, **overrides}
    parameters = merged.get("rope_parameters")
    if "rope_theta" in overrides and "rope_parameters" not in overrides and isinstance(parameters, dict):
        merged["rope_parameters"] = {**parameters, "rope_theta": overrides["rope_theta"]}
    return merged
