"""The ``pagoda`` command: ``pagoda serve [MODEL]`` (the HTTP server) and ``pagoda generate [MODEL]``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Optional

from pagoda.cli_models import add_engine_args, add_model_commands, engine_args_from
from pagoda.cli_serve import add_serve_args, run_serve
from pagoda.startup_failure import report_startup_failure
from pagoda.vllm_flags import expand_config_file


def _generate(ns: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
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
    # Listed for --help only: main() hands `pagoda router ...` to the operator package before parsing.
    sub.add_parser("router", help="the request router (pagoda-operator's `pagoda-router`; ARGS passed on)")
    return parser


def _run_router(args: Sequence[str]) -> int:
    """``pagoda router ARGS``: exec ``python -m pagoda_operator.router ARGS`` (the router lives in the operator
    package, which the engine does not import)."""
    import importlib.util
    import os

    if importlib.util.find_spec("pagoda_operator") is None:
        print(
            "pagoda: error: `pagoda router` needs the pagoda-operator package (pip install pagoda-operator)",
            file=sys.stderr,
        )
        return 2
    os.execv(sys.executable, [sys.executable, "-m", "pagoda_operator.router", *args])


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The parsed command line; ``pagoda serve --config FILE`` reads the file's flags first (the command line wins).
    ValueError for a file that cannot be read or names unknown flags."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        args = ["serve", *expand_config_file(args[1:], _subcommand(parser, "serve"))]
    return parser.parse_args(args)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def main(argv: Optional[Sequence[str]] = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["router"]:
        return _run_router(given[1:])
    parser = build_parser()
    try:
        ns = parse_args(parser, argv)
    except ValueError as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2
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
