"""The operator at scale: N ModelDeployments created at once against a real control plane, one operator process.

Measures the time until every ModelDeployment has exactly the children its spec implies, each matching what the
operator's builders produce, and a status whose observedGeneration is the generation; the operator's RSS and CPU;
and its API requests per minute at steady state (reads, writes, watches; counted by the API server itself, see
``operator_bench_common``). Then a spec change of all N and an operator restart (a reconcile-interval change),
each timed to convergence. Run again on a fresh control plane that already holds ``--unrelated`` Deployments
without pagoda labels in another namespace: the operator watches Deployments cluster-wide by label, so neither
its memory nor its request rate should grow with them.

    .venv/bin/python benchmarks/operator_scale.py --smoke      # N=10, 50 unrelated, 15 s windows
    .venv/bin/python benchmarks/operator_scale.py              # N=200, then N=200 with 1,000 unrelated
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from operator_bench_common import (
    OPERATOR_NS,
    POD_NAME,
    RELEASE,
    Api,
    Bench,
    Converger,
    Operator,
    bench_cluster,
    bench_parser,
    child_kinds,
    collection,
    counters,
    exit_on_sigterm,
    host_facts,
    log,
    md_path,
    parse_bench_args,
    steady_state,
    table,
    wait_until,
)

NS, UNRELATED_NS = "pagoda-scale", "unrelated"
READS, WRITES = ("get", "list"), ("write", "event")


def md_body(index: int) -> dict[str, Any]:
    """A CPU ModelDeployment on the built-in model (as crds/examples/cpu-builtin.yaml), varied by ``index``: plain,
    built-in autoscaler, LoRA adapters (a ConfigMap), two replicas (a PodDisruptionBudget), HPA autoscaling."""
    spec: dict[str, Any] = {
        "model": {"servedModelName": "stories260K"},
        "gpus": 0,
        "replicas": 1,
        "maxModelLen": (256, 512, 1024)[index % 3],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    }
    variant = index % 5
    if variant == 1:
        spec["autoscaling"] = {"enabled": True, "mode": "builtin", "minReplicas": 1, "maxReplicas": 3}
    elif variant == 2:
        spec["loraAdapters"] = [{"name": f"sql-{j}", "source": f"org/sql-lora-{j}"} for j in range(1 + index % 3)]
    elif variant == 3:
        spec["replicas"] = 2
    elif variant == 4:
        spec["autoscaling"] = {"enabled": True, "mode": "hpa", "minReplicas": 1, "maxReplicas": 4}
    meta = {"name": f"md-{index:04d}", "namespace": NS}
    return {"apiVersion": "pagoda.dev/v1alpha1", "kind": "ModelDeployment", "metadata": meta, "spec": spec}


async def bounded(concurrency: int, jobs: list[Any]) -> None:
    """Await the coroutines in ``jobs``, at most ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Any) -> None:
        async with gate:
            await job

    await asyncio.gather(*(one(job) for job in jobs))


async def create_unrelated(api: Api, count: int, concurrency: int) -> float:
    """``count`` Deployments without pagoda labels (replicas 0) by server-side apply; the seconds it took."""
    await api.call("POST", "/api/v1/namespaces", {"metadata": {"name": UNRELATED_NS}})
    start = time.monotonic()

    def deployment(i: int) -> dict[str, Any]:
        labels = {"app": f"other-{i}"}
        pod = {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "app", "image": "nginx:1.27"}]}}
        spec = {"replicas": 0, "selector": {"matchLabels": labels}, "template": pod}
        meta = {"name": f"other-{i:04d}", "namespace": UNRELATED_NS, "labels": labels}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}

    path = collection("apps/v1", "deployments", UNRELATED_NS)
    await bounded(concurrency, [api.apply(deployment(i), f"{path}/other-{i:04d}") for i in range(count)])
    return time.monotonic() - start


def handled(text: str) -> int:
    """How many ModelDeployments kopf has handled (``Resuming is processed``, or ``Updating ...`` for one whose
    last change the previous process had not finished)."""
    return text.count(" is processed: ")


async def deployments_settled(api: Api, namespace: str) -> bool:
    """Whether the controller-manager has caught up with every Deployment of ``namespace`` (its ReplicaSet and
    pods exist; they stay Pending without a kubelet), so no Deployment status change is still on its way."""
    for item in await api.list(collection("apps/v1", "deployments", namespace)):
        status, wanted = item.get("status") or {}, item["spec"].get("replicas", 1)
        if status.get("observedGeneration") != item["metadata"]["generation"]:
            return False
        if status.get("replicas", 0) != wanted or status.get("updatedReplicas", 0) != wanted:
            return False
    return True


def requests_summary(before: dict[str, float], after: dict[str, float]) -> str:
    d = {k: after[k] - before[k] for k in after}
    return (
        f"{sum(d[k] for k in READS):.0f} reads, {d['write']:.0f} writes ({d['dry-run']:.0f} dry-run, "
        f"{d['md-write']:.0f} to ModelDeployments), "
        f"{d['event']:.0f} events, {d['watch']:.0f} watches"
    )


async def scenario(bench: Bench, args: argparse.Namespace, unrelated: int, work: Path) -> dict[str, Any]:
    """One fresh control plane: optional unrelated Deployments, the operator, N ModelDeployments, measurements."""
    out: dict[str, Any] = {"count": args.count, "unrelated": unrelated}
    async with Api(bench.cluster.kubeconfig, args.concurrency) as api:
        kinds = await child_kinds(api)
        if unrelated:
            log(f"creating {unrelated} unrelated Deployments in namespace {UNRELATED_NS}")
            out["unrelated create s"] = await create_unrelated(api, unrelated, args.concurrency)
            out["unrelated listed"] = len(await api.list(collection("apps/v1", "deployments", UNRELATED_NS)))
            settled = lambda: deployments_settled(api, UNRELATED_NS)
            out["unrelated settled s"] = await wait_until("their ReplicaSets", settled, args.timeout, 2.0)
        operator = Operator(bench, work / "operator.log", args.reconcile_interval)
        operator.start()
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NS}/leases/{RELEASE}-pagoda"

        async def leading() -> bool:
            return ((await api.call("GET", lease) or {}).get("spec") or {}).get("holderIdentity") == POD_NAME

        try:
            await wait_until("the operator to hold the Lease", leading, 60)
            await asyncio.sleep(5)
            out["rss idle MiB"] = operator.rss_mib()
            converger = Converger(api, kinds, operator, NS)
            log(f"creating {args.count} ModelDeployments at once (concurrency {args.concurrency})")
            before, start = counters(await api.metrics()), time.monotonic()
            await bounded(args.concurrency, [api.call("POST", md_path(NS), md_body(i)) for i in range(args.count)])
            out["create s"] = time.monotonic() - start
            out["converge s"] = await converger.wait("the first convergence", args.timeout) + out["create s"]
            out["requests to converge"] = requests_summary(before, counters(await api.metrics()))
            out["children"] = ", ".join(f"{n} {k}" for k, n in converger.counts.items())
            out["peak rss MiB"] = converger.peak_rss
            log(f"converged in {out['converge s']:.1f} s: {out['children']}; waiting for the controller-manager")
            settled = lambda: deployments_settled(api, NS)
            out["settled s"] = out["converge s"] + await wait_until(
                "pods of every Deployment", settled, args.timeout, 2.0
            )
            log(f"the controller-manager caught up at {out['settled s']:.0f} s; {args.settle_seconds:g} s more")
            await asyncio.sleep(args.settle_seconds)
            log(f"quiet window of {args.quiet_seconds:.0f} s")
            out["steady"] = await steady_state(api, operator, args.quiet_seconds)
            log(f"steady state: {json.dumps({k: round(v, 1) for k, v in out['steady'].items()})}")

            log(f"changing the spec of all {args.count} (maxModelLen 2048)")
            start = time.monotonic()
            patch = {"spec": {"maxModelLen": 2048}}
            await bounded(
                args.concurrency, [api.merge_patch(md_path(NS, f"md-{i:04d}"), patch) for i in range(args.count)]
            )
            waited = await converger.wait("the spec change", args.timeout)  # nan on a timeout
            out["spec change s"] = waited * 0 + time.monotonic() - start

            interval = args.reconcile_interval * 2
            log(f"restarting the operator with PAGODA_RECONCILE_INTERVAL={interval:g} (SIGTERM, then start)")
            operator.stop()
            offset, before = len(operator.log_text()), counters(await api.metrics())
            operator.interval, start = interval, time.monotonic()
            operator.start()

            async def all_resumed() -> bool:
                return handled(operator.log_text()[offset:]) >= args.count

            try:
                out["restart resume s"] = await wait_until("every resource resumed", all_resumed, args.timeout)
                log(f"all {args.count} handled {out['restart resume s']:.1f} s after the restart")
            except TimeoutError:
                out["restart resume s"] = float("nan")
            out["restart requests"] = requests_summary(before, counters(await api.metrics()))
            await converger.wait("convergence after the restart", 60)
            out["violations"] = [] if converger.problems == [] else converger.problems
        finally:
            operator.stop()
    return out


def _unrelated(result: dict[str, Any]) -> str:
    if not result["unrelated"]:
        return "-"
    return f"{result['unrelated listed']:,} in {result['unrelated create s']:.1f} s (ReplicaSets after {result['unrelated settled s']:.0f} s)"


def render(results: list[dict[str, Any]], args: argparse.Namespace, rbac: str) -> str:
    def cell(value: Any, digits: int = 1) -> str:
        return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)

    headers = ["metric", *(f"N={r['count']}, {r['unrelated']:,} unrelated Deployments" for r in results)]
    rows = [
        [label, *(cell(fn(r)) for r in results)]
        for label, fn in [
            ("unrelated Deployments: listed, created in (s)", lambda r: _unrelated(r)),
            ("create N (s, API calls returned)", lambda r: r["create s"]),
            ("all converged (s from first create)", lambda r: r["converge s"]),
            ("children found", lambda r: r["children"]),
            ("controller-manager done with all pods (s)", lambda r: r["settled s"]),
            ("requests until converged", lambda r: r["requests to converge"]),
            ("operator RSS idle, 0 MDs (MiB)", lambda r: r["rss idle MiB"]),
            ("operator RSS peak while converging (MiB)", lambda r: r["peak rss MiB"]),
            ("operator RSS steady (MiB)", lambda r: r["steady"]["rss MiB"]),
            ("operator CPU steady (% of a core)", lambda r: r["steady"]["cpu %"]),
            ("steady reads/min (get + list)", lambda r: sum(r["steady"][k] for k in READS)),
            ("  of which list/min", lambda r: r["steady"]["list"]),
            ("steady writes/min (create/update/patch/delete)", lambda r: r["steady"]["write"]),
            ("  of which dry-run applies/min", lambda r: r["steady"]["dry-run"]),
            ("steady persisted writes/min", lambda r: r["steady"]["write"] - r["steady"]["dry-run"]),
            ("  of which to ModelDeployments/min", lambda r: r["steady"]["md-write"]),
            ("steady Events posted/min", lambda r: r["steady"]["event"]),
            ("steady watch requests/min", lambda r: r["steady"]["watch"]),
            ("steady Lease requests/min", lambda r: r["steady"]["lease"]),
            ("requests rejected by APF (window)", lambda r: r["steady"]["rejected"]),
            ("spec change of all N converged (s)", lambda r: r["spec change s"]),
            ("restart (interval change): all resumed (s)", lambda r: r["restart resume s"]),
            ("restart: requests until resumed", lambda r: r["restart requests"]),
            ("violations at the end", lambda r: len(r["violations"])),
        ]
    ]
    notes = (
        f"host: {host_facts()}; reconcile interval {args.reconcile_interval:g} s; quiet window "
        f"{args.quiet_seconds:g} s; operator RBAC: {rbac}"
    )
    return table(headers, rows) + "\n\n" + notes


def parse_args() -> argparse.Namespace:
    parser = bench_parser(__doc__, "operator_scale", timeout=900, smoke="N=10, 50 unrelated, 15 s windows")
    parser.add_argument("--count", type=int, default=200, help="ModelDeployments created at once")
    parser.add_argument("--unrelated", type=int, default=1000, help="unrelated Deployments of the second run (0: skip)")
    parser.add_argument("--concurrency", type=int, default=16, help="parallel API calls of the benchmark")
    parser.add_argument("--only-unrelated", action="store_true", help="run only the scenario with unrelated objects")
    return parse_bench_args(parser, {"count": 10, "unrelated": 50, "quiet_seconds": 15, "settle_seconds": 5})


def main() -> None:
    exit_on_sigterm()
    args = parse_args()
    plan = ([] if args.only_unrelated else [0]) + ([args.unrelated] if args.unrelated else [])
    results, rbac = [], ""
    for number, unrelated in enumerate(plan):
        work = (args.workdir / f"run{number}").resolve()
        log(f"run {number + 1}/{len(plan)}: N={args.count}, {unrelated} unrelated Deployments; files in {work}")
        with bench_cluster(work, NS) as bench:
            rbac = bench.rbac
            results.append(asyncio.run(scenario(bench, args, unrelated, work)))
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(render(results, args, rbac))
    for result in results:
        for problem in result["violations"][:20]:
            print(f"VIOLATION (N={result['count']}, unrelated={result['unrelated']}): {problem}")


if __name__ == "__main__":
    main()
