"""`pagoda serve`: its flags (besides the engine's) and the step from parsed flags to a running server."""

from __future__ import annotations

import argparse
import os

from pagoda import capabilities as caps
from pagoda.cli_models import engine_args_from
from pagoda.entrypoints.openai.defaults import ServerConfig
from pagoda.options import add_options, from_namespace
from pagoda.vllm_flags import add_vllm_args, apply_vllm_args


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """``pagoda serve``'s own flags: one per field of ``ServerConfig`` and of its ``ServerLimits``; then the
    ``vllm serve`` flags Pagoda has no option of its own for (see :mod:`pagoda.vllm_flags`)."""
    add_options(serve, ServerConfig)
    add_vllm_args(serve)


def run_serve(ns: argparse.Namespace) -> int:
    """Check every flag, then serve until a signal (0) or a failure (non-zero)."""
    from pagoda.entrypoints.openai.api_server import run_server
    from pagoda.entrypoints.openai.auth import resolve_api_keys

    apply_vllm_args(ns)
    _reject_unsupported(ns)
    api_keys = tuple(resolve_api_keys(ns.api_key or [], os.environ))
    config = from_namespace(ServerConfig, ns, engine_args=engine_args_from(ns), api_keys=api_keys)
    config.validate()  # fail fast on bad flags, before binding the port
    return run_server(config, ns.log_level)


def _reject_unsupported(ns: argparse.Namespace) -> None:
    """Flags of features outside the capability contract: parsed (so deployments can already set them) but refused
    clearly, as the operator refuses the matching ModelDeployment fields."""
    if ns.tensor_parallel_size > caps.TENSOR_PARALLEL_MAX:
        raise ValueError(
            f"--tensor-parallel-size {ns.tensor_parallel_size} is not supported: this engine serves at most "
            f"{caps.TENSOR_PARALLEL_MAX} devices per replica"
        )
    if ns.tensor_parallel_size > 1 and ns.enable_lora and not caps.LORA_WITH_TENSOR_PARALLEL:
        raise ValueError("--enable-lora is not supported with --tensor-parallel-size above 1 yet")
    if (ns.lora_modules or ns.lora_modules_file or ns.allow_runtime_lora_updates) and not ns.enable_lora:
        raise ValueError("--lora-modules, --lora-modules-file and --allow-runtime-lora-updates need --enable-lora")
