"""The operator killed with SIGKILL at random points while ModelDeployments are created, changed and deleted.

A driver keeps about ``--live`` ModelDeployments alive (names drawn from a pool twice that size, so a name is
often reused right after its deletion) and changes them at ``--rate`` operations per second: maxModelLen,
resources, nodeSelector added or removed, the loraAdapters list changed or removed (the ConfigMap child comes and
goes), autoscaling off / built-in / HPA (the HPA child, and who owns Deployment.spec.replicas), replicas 0-2 (the
PodDisruptionBudget from two on). Meanwhile the operator (``python -m pagoda_operator.run``, as the chart runs it)
is SIGKILLed ``--kills`` times after a random 1-8 s of life and restarted after a random 0-3 s.

Then the churn stops and the benchmark waits (``--timeout``) until ``check`` finds nothing: every live
ModelDeployment has exactly the children its spec implies, each equal in the operator-owned fields to what the
operator's builders produce for the current spec (container args, env, resources, nodeSelector, volumes,
replicas, the ConfigMap's adapters.json, ...), status.observedGeneration == metadata.generation, and no child of a
deleted ModelDeployment is left (the controller-manager's garbage collector runs here). What is still wrong at the
timeout is reported as a violation. A quiet window afterwards (after ``--settle-seconds``) shows what the converged
operator still writes.

    .venv/bin/python benchmarks/operator_chaos.py --smoke     # 5 kills, 10 live
    .venv/bin/python benchmarks/operator_chaos.py             # 50 kills, 30 live
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from operator_bench_common import (
    Api,
    ApiError,
    Bench,
    Converger,
    Operator,
    bench_cluster,
    bench_parser,
    child_kinds,
    exit_on_sigterm,
    host_facts,
    log,
    md_path,
    parse_bench_args,
    steady_state,
    table,
)

NS = "pagoda-chaos"
ADAPTERS = ("sql", "chat", "code", "math")
RESOURCES = (
    {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    {"requests": {"memory": "512Mi"}},
)


def _max_model_len(spec: dict[str, Any], rng: random.Random) -> None:
    value = rng.choice((256, 512, 1024, None))
    if value is None:
        spec.pop("maxModelLen", None)
    else:
        spec["maxModelLen"] = value


def _resources(spec: dict[str, Any], rng: random.Random) -> None:
    spec["resources"] = copy.deepcopy(rng.choice(RESOURCES))


def _node_selector(spec: dict[str, Any], rng: random.Random) -> None:
    if "nodeSelector" in spec and rng.random() < 0.6:
        del spec["nodeSelector"]
    else:
        spec["nodeSelector"] = {"pool": rng.choice(("a", "b")), **({"zone": "z1"} if rng.random() < 0.3 else {})}


def _lora(spec: dict[str, Any], rng: random.Random) -> None:
    if "loraAdapters" in spec and rng.random() < 0.4:
        del spec["loraAdapters"]
    else:
        names = rng.sample(ADAPTERS, rng.randint(0, 3))
        spec["loraAdapters"] = [{"name": n, "source": f"org/{n}-lora"} for n in names]


def _autoscaling(spec: dict[str, Any], rng: random.Random) -> None:
    choice = rng.choice(("off", "disabled", "builtin", "hpa"))
    if choice == "off":
        spec.pop("autoscaling", None)
    elif choice == "disabled":
        spec["autoscaling"] = {"enabled": False}
    else:
        low = rng.randint(1, 2)
        spec["autoscaling"] = {"enabled": True, "mode": choice, "minReplicas": low, "maxReplicas": low + 2}


def _replicas(spec: dict[str, Any], rng: random.Random) -> None:
    spec["replicas"] = rng.choice((0, 1, 1, 2))


MUTATIONS: dict[str, Callable[[dict[str, Any], random.Random], None]] = {
    "maxModelLen": _max_model_len,
    "resources": _resources,
    "nodeSelector": _node_selector,
    "loraAdapters": _lora,
    "autoscaling": _autoscaling,
    "replicas": _replicas,
}


def merge_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns ``old`` into ``new`` (removed keys become null; lists are replaced)."""
    patch: dict[str, Any] = {}
    for key in old.keys() | new.keys():
        if key not in new:
            patch[key] = None
        elif isinstance(new[key], dict) and isinstance(old.get(key), dict):
            if sub := merge_diff(old[key], new[key]):
                patch[key] = sub
        elif old.get(key) != new[key]:
            patch[key] = new[key]
    return patch


class Driver:
    """Creates, changes and deletes ModelDeployments; ``live`` holds the spec it last wrote for each."""

    def __init__(self, api: Api, rng: random.Random, live_target: int) -> None:
        self.api, self.rng, self.target = api, rng, live_target
        self.pool = [f"md-{i:03d}" for i in range(2 * live_target)]
        self.live: dict[str, dict[str, Any]] = {}
        self.ops: Counter[str] = Counter()

    def random_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"model": {"servedModelName": "stories260K"}, "gpus": 0, "replicas": 1}
        for mutate in self.rng.sample(list(MUTATIONS.values()), self.rng.randint(1, 4)):
            mutate(spec, self.rng)
        return spec

    async def step(self) -> None:
        draw = self.rng.random()
        if not self.live or (len(self.live) < self.target and draw < 0.5):
            await self.create()
        elif len(self.live) >= self.target and draw < 0.3:
            await self.delete()
        else:
            await self.update()

    async def create(self) -> None:
        name = self.rng.choice([n for n in self.pool if n not in self.live])
        spec = self.random_spec()
        body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": name}}
        try:
            await self.api.call("POST", md_path(NS), {**body, "spec": spec})
        except ApiError as error:
            if error.status != 409:  # 409: its previous incarnation is still being deleted
                raise
            self.ops["create refused (name still terminating)"] += 1
            return
        self.live[name] = spec
        self.ops["create"] += 1

    async def update(self) -> None:
        name = self.rng.choice(sorted(self.live))
        spec = copy.deepcopy(self.live[name])
        changed = self.rng.sample(sorted(MUTATIONS), self.rng.randint(1, 2))
        for field in changed:
            MUTATIONS[field](spec, self.rng)
        patch = merge_diff(self.live[name], spec)
        if patch:
            await self.api.merge_patch(md_path(NS, name), {"spec": patch})
            self.live[name] = spec
            self.ops["update"] += 1
            self.ops.update(f"  changed {field}" for field in changed)

    async def delete(self) -> None:
        name = self.rng.choice(sorted(self.live))
        await self.api.call("DELETE", md_path(NS, name))
        del self.live[name]
        self.ops["delete"] += 1

    async def run(self, stop: asyncio.Event, rate: float) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except ApiError as error:
                self.ops[f"failed (HTTP {error.status})"] += 1
                log(f"driver: {error}")
            await asyncio.sleep(self.rng.expovariate(rate))


async def killer(operator: Operator, kills: int, rng: random.Random, up: tuple[float, float]) -> list[float]:
    """SIGKILL the operator ``kills`` times after a random uptime, restarting it 0-3 s later; the uptimes."""
    uptimes = []
    for number in range(1, kills + 1):
        uptime = rng.uniform(*up)
        await asyncio.sleep(uptime)
        operator.kill()
        uptimes.append(uptime)
        down = rng.uniform(0, 3)
        if number % 10 == 0 or number == kills:
            log(f"kill {number}/{kills} after {uptime:.1f} s up; restart in {down:.1f} s")
        await asyncio.sleep(down)
        operator.start()
    return uptimes


async def run(bench: Bench, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    out: dict[str, Any] = {}
    async with Api(bench.cluster.kubeconfig) as api:
        kinds = await child_kinds(api)
        operator = Operator(bench, work / "operator.log", args.reconcile_interval)
        operator.start()
        driver, stop = Driver(api, rng, args.live), asyncio.Event()
        try:
            churn = asyncio.create_task(driver.run(stop, args.rate))
            start = time.monotonic()
            out["uptimes"] = await killer(operator, args.kills, rng, (args.min_uptime, args.max_uptime))
            stop.set()
            await churn
            out["churn s"] = time.monotonic() - start
            out["ops"] = dict(sorted(driver.ops.items()))
            log(f"churn stopped after {out['churn s']:.0f} s: {json.dumps(out['ops'])}")
            converger = Converger(api, kinds, operator, NS)
            out["converge s"] = await converger.wait("convergence", args.timeout)
            out["final"], out["violations"] = converger.counts, converger.problems
            problems = len(converger.problems)
            log(f"{problems} violations; {args.settle_seconds:g} s to settle, then {args.quiet_seconds:g} s quiet")
            await asyncio.sleep(args.settle_seconds)  # the controller-manager finishes the last rollouts
            out["quiet"] = await steady_state(api, operator, args.quiet_seconds)
            await converger.converged()
            out["final"] = converger.counts  # the objects at the end: after the quiet window
            out["violations after quiet"] = converger.problems
        finally:
            stop.set()
            operator.stop()
        out["starts"] = operator.starts
        text = operator.log_text()
        out["log errors"] = sum(1 for line in text.splitlines() if "[ERROR" in line)
        out["tracebacks"] = text.count("Traceback (most recent call last)")
    return out


def render(out: dict[str, Any], args: argparse.Namespace, rbac: str) -> str:
    ops = out["ops"]
    quiet = out["quiet"]
    rows = [
        ["SIGKILLs (operator starts)", f"{len(out['uptimes'])} ({out['starts']})"],
        ["operator uptime before a kill (s, min/mean/max)", _spread(out["uptimes"])],
        ["churn duration (s)", f"{out['churn s']:.0f}"],
        ["operations done", ", ".join(f"{k.strip()} {v}" for k, v in ops.items() if not k.startswith(" "))],
        ["  fields changed", ", ".join(f"{k.strip()} {v}" for k, v in ops.items() if k.startswith(" "))],
        ["objects at the end", ", ".join(f"{n} {k}" for k, n in out.get("final", {}).items())],
        ["convergence after the churn stopped (s)", f"{out['converge s']:.1f}"],
        ["violations at convergence / timeout", str(len(out["violations"]))],
        [f"violations after a {args.quiet_seconds:g} s quiet window", str(len(out["violations after quiet"]))],
        ["quiet window: persisted writes/min", f"{quiet['write'] - quiet['dry-run']:.1f}"],
        ["  of which to ModelDeployments/min; Events/min", f"{quiet['md-write']:.1f}; {quiet['event']:.1f}"],
        ["quiet window: dry-run applies/min, reads/min", f"{quiet['dry-run']:.1f}, {quiet['get'] + quiet['list']:.1f}"],
        ["operator log: ERROR lines, tracebacks", f"{out['log errors']}, {out['tracebacks']}"],
    ]
    notes = (
        f"host: {host_facts()}; seed {args.seed}; {args.live} live, {args.rate:g} ops/s; reconcile interval "
        f"{args.reconcile_interval:g} s; timeout {args.timeout:g} s; operator RBAC: {rbac}"
    )
    return table(["metric", "value"], rows) + "\n\n" + notes


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {sum(values) / len(values):.1f} / {max(values):.1f}" if values else "-"


def parse_args() -> argparse.Namespace:
    smoke = "5 kills, 10 live, 5 s settling, 10 s quiet window"
    parser = bench_parser(__doc__, "operator_chaos", timeout=120, smoke=smoke)
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs of the operator")
    parser.add_argument("--live", type=int, default=30, help="ModelDeployments kept alive by the driver")
    parser.add_argument("--rate", type=float, default=3.0, help="driver operations per second (Poisson)")
    parser.add_argument("--min-uptime", type=float, default=1.0, help="shortest operator life before a kill (s)")
    parser.add_argument("--max-uptime", type=float, default=8.0, help="longest operator life before a kill (s)")
    parser.add_argument("--seed", type=int, default=22)
    return parse_bench_args(parser, {"kills": 5, "live": 10, "settle_seconds": 5, "quiet_seconds": 10})


def main() -> None:
    exit_on_sigterm()
    args = parse_args()
    work = args.workdir.resolve()
    log(f"{args.kills} kills, {args.live} live ModelDeployments; files in {work}")
    with bench_cluster(work, NS) as bench:
        out = asyncio.run(run(bench, args, work))
    (work / "results.json").write_text(json.dumps(out, indent=2, default=str))
    print(render(out, args, bench.rbac))
    for problem in out["violations"]:
        print(f"VIOLATION: {problem}")
    for problem in out["violations after quiet"]:
        print(f"VIOLATION (after the quiet window): {problem}")


if __name__ == "__main__":
    main()
