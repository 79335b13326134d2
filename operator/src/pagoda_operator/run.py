"""``python -m pagoda_operator.run``: the operator behind Lease leader election, for more than one replica.

Every replica serves ``/healthz`` and stands by until it holds the Lease; the holder runs kopf in-process
(standalone: the Lease, not kopf peering, decides who acts). A holder that cannot renew within its renew deadline stops
acting and exits 1, so Kubernetes restarts it as a standby; on SIGTERM it hands the Lease back, so a standby takes
over at its next attempt instead of after the lease time. Every write, ours and kopf's, is fenced by the elector:
past the renew deadline (2/3 of the lease) none is sent, even before kopf has stopped (``leader``).

    python -m pagoda_operator.run --lease-name pagoda-operator --lease-namespace pagoda-system --all-namespaces

The replica's identity is ``$POD_NAME`` (the chart sets it from the pod), else ``hostname-pid``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from typing import NoReturn, Optional

import kopf
from aiohttp import web

from pagoda_operator.kube import KubeClient
from pagoda_operator.leader import RENEW_DEADLINE_FRACTION, LeaseElector, fence_kopf_writes

logger = logging.getLogger(__name__)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lease-name", required=True, help="the Lease replicas compete for")
    parser.add_argument("--lease-namespace", required=True, help="where the Lease lives (the operator's namespace)")
    parser.add_argument("--lease-seconds", type=int, default=10, help="a holder silent this long loses the Lease")
    parser.add_argument("--retry-seconds", type=float, default=2.0, help="renew (holder) or retry (standby) period")
    parser.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    parser.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--health-port", type=int, default=8080, help="GET /healthz answers here (0: off)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if bool(args.namespace) == args.all_namespaces:
        parser.error("give --all-namespaces or at least one --namespace")
    if not 0 < args.retry_seconds < args.lease_seconds * RENEW_DEADLINE_FRACTION:  # see leader.LeaseElector
        parser.error("--retry-seconds must be below 2/3 of --lease-seconds, to renew before the deadline")
    return args


async def _health_server(port: int) -> Optional[web.AppRunner]:
    if not port:
        return None
    app = web.Application()
    app.router.add_get("/healthz", lambda _: web.json_response({"status": "ok"}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


def _exit_now(status: int) -> NoReturn:
    """Exit at once, not through ``asyncio.run``'s shutdown: kopf leaves orphaned handler tasks behind when stopped
    mid-way, and waiting for them could keep a replica that lost the Lease (fenced, but alive) from restarting."""
    logging.shutdown()
    os._exit(status)


async def run(args: argparse.Namespace) -> int:
    """Stand by, lead, and return the exit status (0); when the Lease is lost, exit 1 from here."""
    import pagoda_operator.main  # noqa: F401  (registers the handlers with kopf)

    health = await _health_server(args.health_port)
    kube = KubeClient.from_environment(kopf.OperatorSettings())
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    elector = LeaseElector(
        kube, args.lease_namespace, args.lease_name, identity, args.lease_seconds, args.retry_seconds
    )
    fence_kopf_writes(elector.fence)
    try:
        await elector.acquire()
        stop = asyncio.Event()
        memo = kopf.Memo(fence=elector.fence)  # main.startup hands it to the operator's KubeClient
        operator = asyncio.create_task(
            kopf.operator(
                clusterwide=args.all_namespaces, namespaces=args.namespace, standalone=True, stop_flag=stop, memo=memo
            )
        )
        keeper = asyncio.create_task(elector.keep())
        done, _ = await asyncio.wait({operator, keeper}, return_when=asyncio.FIRST_COMPLETED)
        if keeper in done:  # lost: writes are fenced already; stop kopf before a standby can take over
            stop.set()
            await asyncio.wait({operator}, timeout=args.lease_seconds - elector.renew_deadline)
            _exit_now(1)
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await elector.release()
        operator.result()  # re-raise what stopped kopf, if anything did
        return 0
    finally:
        await kube.close()
        if health is not None:
            await health.cleanup()


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    kopf.configure(verbose=args.verbose)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
