"""The ``vllm serve`` flags of :data:`~pagoda.vllm_flags.table.VLLM_FLAGS` that Pagoda's own options do not
declare: added to ``pagoda serve``'s parser, then read once the command line is parsed (refused, warned about, or
mapped onto the Pagoda setting of the same meaning)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from pagoda.model_overrides import json_object_flag
from pagoda.vllm_flags.table import CHECKED, DEFAULT, MAPPED, NO_EFFECT, PAGODA, REFUSED, VLLM_FLAGS, VllmFlag

logger = logging.getLogger("pagoda.vllm_flags")

STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")
# vLLM's StructuredOutputsConfig keys Pagoda takes: the backend, and two that change nothing with its one backend.
STRUCTURED_OUTPUT_KEYS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties")
_TYPES: dict[str, Any] = {"int": int, "float": float}


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags Pagoda does not declare itself, in a group of their own (``--help`` says what each does)."""
    group = parser.add_argument_group(
        "vllm serve compatibility", "vLLM's flags, accepted so that a vllm serve command line runs unchanged"
    )
    for entry in VLLM_FLAGS:
        if entry.kind == PAGODA:
            continue
        names = [entry.flag, entry.short] if entry.short else [entry.flag]
        group.add_argument(*names, dest=entry.dest, default=None, help=_help(entry), **_settings(entry))


def _settings(entry: VllmFlag) -> dict[str, Any]:
    if entry.takes == "switch":  # --x and --no-x; --no-x (False) asks for nothing
        return {"action": argparse.BooleanOptionalAction}
    if entry.takes == "optional":
        return {"nargs": "?", "const": True}
    return {"type": _TYPES[entry.takes]} if entry.takes in _TYPES else {}


def _help(entry: VllmFlag) -> str:
    if entry.kind == NO_EFFECT:
        return f"no effect in Pagoda ({entry.meaning})"
    if entry.kind == REFUSED:
        return f"refused: {entry.meaning}"
    if entry.kind == CHECKED:
        return f"{entry.meaning}; accepted: {', '.join(map(str, entry.accepted))}"
    return entry.meaning


def apply_vllm_args(ns: argparse.Namespace) -> None:
    """Read the vLLM flags of a parsed ``pagoda serve`` command line: ValueError (one line) for a refused flag or
    value, one warning per flag that has no effect, and the mapped ones set onto ``ns``."""
    for entry in VLLM_FLAGS:
        value = getattr(ns, entry.dest, None) if entry.kind != PAGODA else None
        if value is None or value is False:
            continue
        if entry.kind == REFUSED:
            raise ValueError(f"{entry.flag} is refused: {entry.meaning}")
        if entry.kind == NO_EFFECT:
            logger.warning("%s has no effect in Pagoda: %s", entry.flag, entry.meaning)
        elif entry.kind == CHECKED:
            _check_value(entry, value)
        elif entry.kind == MAPPED:
            _MAPPED[entry.flag](ns, value)
        else:
            assert entry.kind == DEFAULT, entry


def _check_value(entry: VllmFlag, value: Any) -> None:
    if value not in entry.accepted:
        accepted = ", ".join(map(str, entry.accepted))
        raise ValueError(f"{entry.flag} {value} is not supported ({entry.meaning}); accepted: {accepted}")
    if entry.flag == "--tokenizer-mode" and value == "slow":
        logger.warning("--tokenizer-mode slow has no effect in Pagoda: the fast tokenizer (tokenizer.json) is used")


def _model(ns: argparse.Namespace, value: str) -> None:
    if ns.model is not None and ns.model != value:
        raise ValueError(f"--model {value} and the positional MODEL {ns.model} differ: give the model once")
    ns.model = value


def _config(ns: argparse.Namespace, value: str) -> None:
    raise ValueError(f"--config {value}: the file is read by `pagoda serve` itself (pagoda.vllm_flags.config_file)")


def _structured_outputs_config(ns: argparse.Namespace, value: str) -> None:
    config = json_object_flag("--structured-outputs-config")(value)
    unknown = sorted(set(config) - set(STRUCTURED_OUTPUT_KEYS))
    if unknown:
        raise ValueError(
            f"--structured-outputs-config: {', '.join(map(repr, unknown))} not supported "
            f"(accepted keys: {', '.join(STRUCTURED_OUTPUT_KEYS)})"
        )
    _backend("--structured-outputs-config backend", str(config.get("backend", "auto")))


def _guided_decoding_backend(ns: argparse.Namespace, value: str) -> None:
    _backend("--guided-decoding-backend", value.split(":", 1)[0])  # vLLM's "xgrammar:disable-any-whitespace" form


def _backend(what: str, backend: str) -> None:
    if backend not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(
            f"{what} {backend!r} is not supported: Pagoda's structured outputs are xgrammar's (accepted: auto, xgrammar)"
        )


def _hf_token(ns: argparse.Namespace, value: Any) -> None:
    if value is not True:  # bare --hf-token: huggingface_hub uses the cached login anyway
        os.environ["HF_TOKEN"] = str(value)


def _tokenizer_revision(ns: argparse.Namespace, value: str) -> None:
    if ns.tokenizer is not None or value != ns.revision:
        raise ValueError(
            f"--tokenizer-revision {value} is not supported: the tokenizer is read at the model's --revision "
            f"({ns.revision or 'main'}) from the model's or --tokenizer's files"
        )


_MAPPED: dict[str, Callable[[argparse.Namespace, Any], None]] = {
    "--model": _model,
    "--config": _config,
    "--structured-outputs-config": _structured_outputs_config,
    "--guided-decoding-backend": _guided_decoding_backend,
    "--hf-token": _hf_token,
    "--tokenizer-revision": _tokenizer_revision,
}
