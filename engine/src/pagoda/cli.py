"""The ``pagoda`` command: ``pagoda serve [MODEL]`` (the HTTP server) and ``pagoda generate [MODEL]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Optional

from pagoda.cli_models import add_model_arg, add_model_commands
from pagoda.cli_serve import add_serve_args, run_serve
from pagoda.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DISTRIBUTED_TIMEOUT_S,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineArgs,
)
from pagoda.startup_failure import report_startup_failure


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named like ``vllm serve``'s."""
    add_model_arg(parser)
    parser.add_argument("--tokenizer", default=None, help="tokenizer: the same forms as MODEL (default: the model's)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weights and activations; auto: the checkpoint's dtype",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when available")
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=list(QUANTIZATIONS),
        help="default: the checkpoint's (config.json quantization_config). awq, gptq: int4/int8 checkpoints; fp8: an "
        "FP8 checkpoint, or FP8 applied at load; int8: weight-only int8 applied at load (CPU)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="auto: the model's dtype; fp8_e4m3 / fp8_e5m2: FP8 KV blocks (twice the tokens; per-tensor scales from "
        "the checkpoint, else 1.0)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="CPU KV cache budget, e.g. 2GiB (default: 4GiB, or less if max-num-seqs full sequences need less)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="fraction of GPU memory for weights, activations and KV cache",
    )
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="sequences per step")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"token budget per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS} with chunked prefill)",
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse cached KV blocks"
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over steps so decodes keep flowing",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the engine's RNG (unseeded requests)")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template (file path or inline)")
    parser.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "vllm"],
        help="auto: the model's generation_config.json sets default sampling params; vllm: ignore it",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="attention kernels; auto: triton on CUDA, torch on CPU",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs for decode steps)"
    )
    parser.add_argument(
        "--structured-output-max-whitespace",
        type=int,
        default=0,
        help="structured outputs: longest run of free whitespace between JSON tokens; 0 (default): JSON as "
        "json.dumps writes it, which no model can pad with whitespace until max_tokens",
    )
    _add_lora_args(parser)
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many devices (CPU: processes sharing the cores), one process each; it must "
        "divide the model's attention heads and intermediate size",
    )
    parser.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=DEFAULT_DISTRIBUTED_TIMEOUT_S,
        help="tensor parallelism: a rank that does not reach a collective within this time (dead or hung) stops "
        "the engine, and the server exits non-zero",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters next to the base model")
    parser.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help="adapters resident in the device's slots at once; one step never mixes more",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_LORA_RANK,
        help="the largest adapter rank served (the slots' width): one of 8, 16, 32, 64, 128, 256",
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded in host memory (default: max-loras); beyond it the least recently used is "
        "read again from disk when next needed",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    chat_template = ns.chat_template
    if chat_template is not None and not ("{" in chat_template or "\n" in chat_template):
        with open(chat_template, encoding="utf-8") as f:  # a path, not an inline template
            chat_template = f.read()
    return EngineArgs(
        model=ns.model,
        tokenizer=ns.tokenizer,
        revision=ns.revision,
        download_dir=ns.download_dir,
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.max_model_len,
        block_size=ns.block_size,
        kv_cache_memory=ns.kv_cache_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_prefix_caching=ns.enable_prefix_caching,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        seed=ns.seed,
        chat_template=chat_template,
        generation_config=ns.generation_config,
        attention_backend=ns.attention_backend,
        enforce_eager=ns.enforce_eager,
        quantization=ns.quantization,
        kv_cache_dtype=ns.kv_cache_dtype,
        structured_output_max_whitespace=ns.structured_output_max_whitespace,
        enable_lora=ns.enable_lora,
        max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        max_cpu_loras=ns.max_cpu_loras,
        tensor_parallel_size=ns.tensor_parallel_size,
        distributed_timeout_seconds=ns.distributed_timeout_seconds,
    )


def _generate(ns: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    llm = LLM(**{k: v for k, v in _asdict(engine_args_from(ns)).items()})
    params = SamplingParams(
        n=ns.n,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        max_tokens=ns.max_tokens,
        seed=ns.sampling_seed,
    )
    prompts = ns.prompt or ["Once upon a time"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for output in outputs:
        for completion in output.outputs:
            if ns.json:
                print(
                    json.dumps(
                        {
                            "prompt": output.prompt,
                            "index": completion.index,
                            "text": completion.text,
                            "token_ids": completion.token_ids,
                            "finish_reason": completion.finish_reason,
                        }
                    )
                )
            else:
                print(f"--- {output.prompt!r} [{completion.index}] ({completion.finish_reason})")
                print(output.prompt + completion.text)
    logging.getLogger("pagoda").info(
        "generated %d tokens for %d prompts in %.2f s (%.1f tok/s)",
        num_generated,
        len(prompts),
        elapsed,
        num_generated / elapsed if elapsed > 0 else 0.0,
    )
    return 0


def _asdict(args: EngineArgs) -> dict:
    return {name: getattr(args, name) for name in args.__dataclass_fields__}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where the help text does not already say what the default is,
    and never ``(default: None)``: those flags' help explains what happens when they are left out."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="offline generation with the built-in or a local model",
        formatter_class=_HelpFormatter,
    )
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: 'Once upon a time')")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per sequence")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables")
    gen.add_argument("-n", type=int, default=1, help="sequences per prompt")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--json", action="store_true", help="print one JSON object per completion")
    gen.set_defaults(handler=_generate)
    serve = sub.add_parser(
        "serve",
        help="the OpenAI-compatible HTTP server",
        formatter_class=_HelpFormatter,
    )
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(handler=run_serve)
    add_model_commands(sub, serve, _HelpFormatter)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return ns.handler(ns)
    except (ValueError, OSError) as exc:
        # One line on stderr and in the termination message (kubectl describe): the reason, then the cause.
        print(f"pagoda: error: {report_startup_failure(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
