"""The engine's flags (the model argument among them, which every command takes), ``pagoda download`` and
``pagoda capabilities``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from pagoda.config import EngineArgs
from pagoda.options import add_options, from_namespace

# The flags `pagoda download` shares with the engine's: MODEL, and where and which version of it to download.
MODEL_OPTIONS = ("model", "revision", "download_dir")
# --help lists these first: the model, then what its weights and KV cache are stored as; the rest in field order.
_LEADING_ENGINE_OPTIONS = (*MODEL_OPTIONS, "tokenizer", "dtype", "device", "quantization", "kv_cache_dtype")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """MODEL, and where and which version of it to download."""
    add_options(parser, EngineArgs, only=MODEL_OPTIONS)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named like ``vllm serve``'s: one per field of :class:`~pagoda.config.EngineArgs`."""
    add_options(parser, EngineArgs, only=_LEADING_ENGINE_OPTIONS)
    add_options(parser, EngineArgs, exclude=_LEADING_ENGINE_OPTIONS)
    add_log_level_arg(parser, "info", help="log level")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The engine flags of a parsed command line (``--chat-template`` naming a file: the file's template)."""
    return from_namespace(EngineArgs, ns)


def add_log_level_arg(parser: argparse.ArgumentParser, default: str, help: Optional[str] = None) -> None:
    parser.add_argument("--log-level", default=default, choices=list(LOG_LEVELS), help=help)


def add_model_commands(sub, serve: argparse.ArgumentParser, formatter: type[argparse.HelpFormatter]) -> None:
    """``pagoda download`` and ``pagoda capabilities`` (the latter lists ``serve``'s flags)."""
    download = sub.add_parser(
        "download",
        help="fetch a model's files into the cache (what `serve` would do first) and print their folder",
        formatter_class=formatter,
    )
    add_model_arg(download)
    add_log_level_arg(download, "info", help="log level")
    download.set_defaults(handler=_download)
    capabilities = sub.add_parser(
        "capabilities", help="what this engine can serve (the contract the operator checks specs against)"
    )
    capabilities.add_argument("--json", action="store_true", help="print JSON (the default is the same, indented)")
    add_log_level_arg(capabilities, "warning")
    capabilities.set_defaults(handler=lambda ns: _capabilities(ns, serve))


def _download(ns: argparse.Namespace) -> int:
    # An init container runs this to fill the cache before the engine starts; with PAGODA_OFFLINE=1 it only checks
    # that the cache holds the model.
    print(EngineArgs(**{name: getattr(ns, name) for name in MODEL_OPTIONS}).resolved_model_path())
    return 0


def _capabilities(ns: argparse.Namespace, serve: argparse.ArgumentParser) -> int:
    from pagoda.capabilities import capabilities
    from pagoda.models.registry import supported_architectures
    from pagoda.vllm_flags import flag_table

    # architectures: what --task generate serves (config.json's `architectures`); the pooling tasks add encoders
    data = capabilities(serve) | {"vllm_flags": flag_table(), "architectures": supported_architectures()}
    print(json.dumps(data, sort_keys=True) if ns.json else json.dumps(data, indent=2, sort_keys=True))
    sys.stdout.flush()
    return 0
