"""The model argument every command takes, ``pagoda download`` and ``pagoda capabilities``."""

from __future__ import annotations

import argparse
import json
import sys

MODEL_HELP = (
    "a local model directory, a Hugging Face id (org/name or hf://org/name) or s3://bucket/prefix "
    "(default: the built-in stories260K)"
)


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """MODEL, and where and which version of it to download."""
    parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    parser.add_argument(
        "--revision", default=None, help="Hugging Face branch, tag or commit; a commit pins the files (default: main)"
    )
    parser.add_argument(
        "--download-dir",
        default=None,
        help="where downloads go (default: the Hugging Face cache under HF_HOME for Hub models, "
        "$PAGODA_CACHE_DIR/models or ~/.cache/pagoda/models for S3)",
    )


def add_model_commands(sub, serve: argparse.ArgumentParser, formatter: type[argparse.HelpFormatter]) -> None:
    """``pagoda download`` and ``pagoda capabilities`` (the latter lists ``serve``'s flags)."""
    download = sub.add_parser(
        "download",
        help="fetch a model's files into the cache (what `serve` would do first) and print their folder",
        formatter_class=formatter,
    )
    add_model_arg(download)
    download.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level"
    )
    download.set_defaults(handler=_download)
    capabilities = sub.add_parser(
        "capabilities", help="what this engine can serve (the contract the operator checks specs against)"
    )
    capabilities.add_argument("--json", action="store_true", help="print JSON (the default is the same, indented)")
    capabilities.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    capabilities.set_defaults(handler=lambda ns: _capabilities(ns, serve))


def _download(ns: argparse.Namespace) -> int:
    from pagoda.config import builtin_model_path
    from pagoda.model_source import resolve_model

    # An init container runs this to fill the cache before the engine starts; with PAGODA_OFFLINE=1 it only checks
    # that the cache holds the model.
    path = resolve_model(ns.model, ns.revision, ns.download_dir, builtin=builtin_model_path())
    print(path)
    return 0


def _capabilities(ns: argparse.Namespace, serve: argparse.ArgumentParser) -> int:
    from pagoda.capabilities import capabilities

    data = capabilities(serve)
    print(json.dumps(data, sort_keys=True) if ns.json else json.dumps(data, indent=2, sort_keys=True))
    sys.stdout.flush()
    return 0
