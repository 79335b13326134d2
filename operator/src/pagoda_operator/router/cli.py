"""The router's command line: ``pagoda-router``, ``python -m pagoda_operator.router``, ``pagoda router``.

    pagoda-router --namespace team-a --port 8080              # ModelDeployments of one namespace (repeatable)
    pagoda-router --all-namespaces
    pagoda-router --static-models models.yaml                 # no Kubernetes: models and URLs from a file

Kubernetes credentials: the in-cluster service account, else ``$KUBECONFIG`` / ``~/.kube/config`` (the operator's
login); ``--kubeconfig FILE`` uses that file. The API keys may come from the environment instead of the command line
(``PAGODA_ROUTER_API_KEY``, ``PAGODA_ROUTER_UPSTREAM_API_KEY``), which keeps them out of ``ps``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Optional

from aiohttp import web

from pagoda_operator.router.app import Router, RouterOptions, build_app
from pagoda_operator.router.static_models import ModelTable, load_static_models, watch_static_file

logger = logging.getLogger("pagoda_operator.router")


def build_parser() -> argparse.ArgumentParser:
    """The router's flags."""
    p = argparse.ArgumentParser(
        prog="pagoda-router", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    source = p.add_argument_group("where the models come from (one of)")
    source.add_argument("--namespace", "-n", action="append", default=[], help="follow this namespace (repeatable)")
    source.add_argument("--all-namespaces", "-A", action="store_true", help="follow every namespace")
    source.add_argument("--static-models", metavar="FILE", help="a YAML file of models and endpoint URLs (no k8s)")
    p.add_argument("--kubeconfig", metavar="FILE", help="log in with this kubeconfig (default: as the operator)")
    auth = p.add_argument_group("API keys")
    auth.add_argument(
        "--api-key",
        default=os.environ.get("PAGODA_ROUTER_API_KEY") or None,
        help="require `Authorization: Bearer KEY` (env PAGODA_ROUTER_API_KEY; default: no check)",
    )
    auth.add_argument(
        "--upstream-api-key",
        default=os.environ.get("PAGODA_ROUTER_UPSTREAM_API_KEY") or None,
        help="send this key to the pods (env PAGODA_ROUTER_UPSTREAM_API_KEY; default: the client's)",
    )
    _add_upstream_args(p)
    _add_routing_args(p)
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="default: %(default)s"
    )
    return p


def _add_upstream_args(p: argparse.ArgumentParser) -> None:
    up = p.add_argument_group("upstream")
    up.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="other endpoints to try after a connection failure or a 503 (default: %(default)s)",
    )
    up.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect (default: %(default)s)")
    up.add_argument(
        "--read-timeout",
        type=float,
        default=0.0,
        help="longest silence of an upstream reply in seconds; 0: none (default: %(default)s)",
    )
    hold = p.add_argument_group("models with no ready pod")
    hold.add_argument(
        "--hold-timeout",
        type=float,
        default=120.0,
        help="seconds a request waits for a ready pod before a 503 (default: %(default)s)",
    )
    hold.add_argument(
        "--max-held-requests",
        type=int,
        default=256,
        help="requests held per model; more get a 503 at once (default: %(default)s)",
    )


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    pick = p.add_argument_group("routing")
    pick.add_argument(
        "--kv-events",
        choices=("auto", "off"),
        default="auto",
        help="auto: subscribe to the KV events of pods that declare the kv-events port",
    )
    pick.add_argument(
        "--load-interval",
        type=float,
        default=1.0,
        help="seconds between scrapes of each endpoint's /metrics (default: %(default)s)",
    )
    pick.add_argument(
        "--load-threshold",
        type=float,
        default=8.0,
        # A continuous batch serves a few more requests at little cost; moving a session to a cold pod costs its
        # whole prefill there. SGLang's cache-aware router balances only past 32 requests of difference.
        help="load difference (about requests in flight) a prefix match may outweigh (default: %(default)s)",
    )
    pick.add_argument("--chunk-chars", type=int, default=128, help="characters per prefix chunk (default: %(default)s)")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parsed and checked flags (exit 2 with a message for bad ones)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    sources = bool(args.namespace) + args.all_namespaces + bool(args.static_models)
    if sources != 1:
        parser.error("give exactly one of --namespace (repeatable), --all-namespaces, --static-models")
    if args.max_retries < 0 or args.max_held_requests < 0 or args.hold_timeout < 0 or args.chunk_chars <= 0:
        parser.error("--max-retries, --max-held-requests and --hold-timeout must not be negative")
    if args.connect_timeout <= 0 or args.read_timeout < 0 or args.load_interval <= 0:
        parser.error("--connect-timeout and --load-interval must be positive, --read-timeout not negative")
    return args


def options_from(args: argparse.Namespace) -> RouterOptions:
    """The application's options from the flags."""
    return RouterOptions(
        api_key=args.api_key,
        upstream_api_key=args.upstream_api_key,
        max_retries=args.max_retries,
        connect_timeout=args.connect_timeout,
        read_timeout=args.read_timeout or None,
        hold_timeout=args.hold_timeout,
        max_held_requests=args.max_held_requests,
        kv_events=args.kv_events == "auto",
        load_interval=args.load_interval,
        load_threshold=args.load_threshold,
        chunk_chars=args.chunk_chars,
    )


def _sources(args: argparse.Namespace, table: ModelTable):  # type: ignore[no-untyped-def]
    """The background coroutine that fills ``table``, the demand stamper (Kubernetes only) and what to close."""
    if args.static_models:
        table.replace_all(load_static_models(args.static_models))
        return (lambda: watch_static_file(args.static_models, table)), None, None
    from pagoda_operator.router.discovery import KubeDiscovery, connect

    kube = connect(args.kubeconfig)
    discovery = KubeDiscovery(kube, table, args.namespace or None, kv_events=args.kv_events == "auto")
    return discovery.run, discovery.stamp_demand, kube


async def serve(args: argparse.Namespace) -> int:
    """Run the router until SIGTERM or SIGINT."""
    table = ModelTable()
    fill, on_demand, kube = _sources(args, table)
    router = Router(table, options_from(args), on_demand=on_demand)
    background: list[Callable[[], Awaitable[None]]] = [fill]
    runner = web.AppRunner(build_app(router, background), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        scope = args.static_models or ("all namespaces" if args.all_namespaces else ", ".join(args.namespace))
        auth = "on" if args.api_key else "off"
        logger.info("pagoda router on %s:%d; models from %s; API key %s", args.host, args.port, scope, auth)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("pagoda router stopping")
    finally:
        await runner.cleanup()
        if kube is not None:
            await kube.close()
    return 0


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of ``pagoda-router``."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":  # the libraries' INFO lines (kopf's login, aiohttp) are noise here
        for name in ("kopf", "aiohttp", "asyncio"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        sys.exit(asyncio.run(serve(args)))
    except (ValueError, OSError) as error:
        print(f"pagoda-router: error: {error}", file=sys.stderr)
        sys.exit(2)
