"""Shared pieces of the operator benchmarks (``operator_scale.py``, ``operator_chaos.py``): the control plane with
the chart's RBAC, the operator as a process under its own ServiceAccount, the API server's per-client request
counters, and a checker that compares every ModelDeployment's children with what the operator's builders produce.

Request attribution: ``apiserver_request_total`` has no client label, so the operator's ServiceAccount gets its own
FlowSchemas (API Priority and Fairness, ``flowcontrol.apiserver.k8s.io/v1beta2``), one per verb class, all on the
``workload-low`` priority level that a ServiceAccount lands on anyway. The API server then counts the operator's
requests by class in ``apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}``; the benchmark itself and
the controller-manager use the admin credential (``system:masters``, the ``exempt`` schema) and are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp
import yaml

from pagoda_operator.builders import Owner, build_children
from pagoda_operator.spec import InvalidSpec, parse_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "operator"))

from control_plane import CLUSTER_SCRIPT, Cluster, cluster_with_crd, helm_template  # noqa: E402  (tests/operator/)

_START = time.monotonic()
GROUP_VERSION = "pagoda.dev/v1alpha1"
MD_PLURAL = "modeldeployments"
OPERATOR_NS, RELEASE = "pagoda-system", "bench"
POD_NAME = f"{RELEASE}-pagoda-0"  # a fixed identity: a restarted container keeps its pod's name
MANAGED_BY = "app.kubernetes.io/managed-by=pagoda-operator"
OWNER_LABEL = "pagoda.dev/model-deployment"
FLOWCONTROL = "flowcontrol.apiserver.k8s.io/v1beta2"
# FlowSchema name suffix -> the verbs (or resources) it takes; first match wins (matchingPrecedence order).
BUCKETS: list[tuple[str, dict[str, Any]]] = [
    ("lease", {"verbs": ["*"], "apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}),
    ("event", {"verbs": ["*"], "apiGroups": ["", "events.k8s.io"], "resources": ["events"]}),
    ("watch", {"verbs": ["watch"], "apiGroups": ["*"], "resources": ["*"]}),
    ("get", {"verbs": ["get"], "apiGroups": ["*"], "resources": ["*"]}),
    ("list", {"verbs": ["list"], "apiGroups": ["*"], "resources": ["*"]}),
    ("write", {"verbs": ["create", "update", "patch", "delete", "deletecollection"], "apiGroups": ["*"]}),
]


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so the operator and the control plane are stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def bench_parser(description: str, name: str, timeout: float, smoke: str) -> argparse.ArgumentParser:
    """The options every operator benchmark takes: the operator's reconcile interval, how long convergence may take
    (``timeout`` s by default), the settling wait and the quiet window after it, the work folder
    (``.bench/NAME``) and ``--smoke`` (``smoke``: what it shrinks, see ``parse_bench_args``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reconcile-interval", type=float, default=30, help="PAGODA_RECONCILE_INTERVAL")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds allowed for each convergence")
    parser.add_argument("--settle-seconds", type=float, default=20, help="wait after convergence, before the window")
    parser.add_argument("--quiet-seconds", type=float, default=60, help="steady-state window after convergence")
    parser.add_argument("--workdir", type=Path, default=Path(".bench") / name)
    parser.add_argument("--smoke", action="store_true", help=smoke)
    return parser


def parse_bench_args(parser: argparse.ArgumentParser, smoke: dict[str, Any]) -> argparse.Namespace:
    """The command line; with ``--smoke``, the values of ``smoke`` (option dest -> value) replace the given ones."""
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(smoke)
    return args


def log(message: str) -> None:
    """Progress line on stderr, prefixed with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def host_facts() -> str:
    """CPU model, core count and date, for the README."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda cells: "| " + " | ".join(f"{c!s:<{w}}" for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


class ApiError(Exception):
    """An API call that failed with an unexpected HTTP status."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


class Api:
    """A small asyncio client with the admin credential (the benchmark's own requests, not counted)."""

    def __init__(self, kubeconfig: str, concurrency: int = 16) -> None:
        config = yaml.safe_load(Path(kubeconfig).read_text())
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        self.server, self._token, self._limit = cluster["server"], user["token"], concurrency
        self._ssl = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> Api:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl, limit=self._limit),
            headers={"Authorization": f"Bearer {self._token}", "User-Agent": "pagoda-operator-bench"},
            timeout=aiohttp.ClientTimeout(total=120),
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._session is not None
        await self._session.close()

    async def call(
        self, method: str, path: str, body: Any = None, query: Optional[dict[str, str]] = None, ctype: str = ""
    ) -> Optional[dict[str, Any]]:
        """One request; the decoded answer, or None for a 404."""
        assert self._session is not None
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": ctype or "application/json"}
        async with self._session.request(
            method, self.server + path, data=data, params=query, headers=headers
        ) as response:
            text = await response.text()
            if response.status == 404:
                return None
            if response.status >= 300:
                raise ApiError(response.status, text)
            return json.loads(text) if text.startswith("{") else {"text": text}

    async def list(self, path: str, selector: str = "") -> list[dict[str, Any]]:
        """Every item of a collection (paginated), optionally label-selected."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            query = {"limit": "500", **({"labelSelector": selector} if selector else {})}
            page = await self.call("GET", path, query={**query, **({"continue": token} if token else {})}) or {}
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items

    async def apply(self, obj: dict[str, Any], path: str, manager: str = "bench") -> None:
        """Server-side apply (creates the object when missing)."""
        query = {"fieldManager": manager, "force": "true"}
        await self.call("PATCH", path, obj, query, "application/apply-patch+yaml")

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> None:
        await self.call("PATCH", path, patch, None, "application/merge-patch+json")

    async def metrics(self) -> str:
        return (await self.call("GET", "/metrics") or {}).get("text", "")


def collection(api_version: str, plural: str, namespace: Optional[str]) -> str:
    """REST path of a (namespaced or cluster-wide) collection."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def md_path(namespace: str, name: str = "") -> str:
    return collection(GROUP_VERSION, MD_PLURAL, namespace) + (f"/{name}" if name else "")


# --- the control plane, the operator's identity and its request counters --------------------------------------


@dataclass
class Bench:
    """A running control plane prepared for the operator: RBAC, a token kubeconfig, FlowSchemas."""

    cluster: Cluster
    operator_kubeconfig: str
    account: str
    rbac: str = "the chart's ClusterRole and leader-election Role (helm template)"


def _chart_rbac() -> list[dict[str, Any]]:
    kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    return [d for d in helm_template(RELEASE, OPERATOR_NS, "operator.replicas=2") if d["kind"] in kinds]


def _flow_schemas(account: str) -> list[dict[str, Any]]:
    subject = {"kind": "ServiceAccount", "serviceAccount": {"name": account, "namespace": OPERATOR_NS}}
    schemas = []
    for precedence, (bucket, rule) in enumerate(BUCKETS, start=1000):
        resource_rule = {"resources": ["*"], "namespaces": ["*"], "clusterScope": True, **rule}
        rules: dict[str, Any] = {"subjects": [subject], "resourceRules": [resource_rule]}
        if bucket == "get":  # discovery (/apis, /version) is a non-resource read
            rules["nonResourceRules"] = [{"verbs": ["*"], "nonResourceURLs": ["*"]}]
        spec = {"matchingPrecedence": precedence, "priorityLevelConfiguration": {"name": "workload-low"}}
        spec |= {"distinguisherMethod": {"type": "ByUser"}, "rules": [rules]}
        meta = {"name": f"pagoda-bench-{bucket}"}
        schemas.append({"apiVersion": FLOWCONTROL, "kind": "FlowSchema", "metadata": meta, "spec": spec})
    return schemas


@contextmanager
def bench_cluster(directory: Path, namespace: str) -> Iterator[Bench]:
    """The control plane with the CRD, ``namespace``, the chart's RBAC (``helm template``), a kubeconfig
    holding only the operator ServiceAccount's token, and the FlowSchemas that count its requests."""
    if not CLUSTER_SCRIPT.exists():
        raise SystemExit(f"needs the control plane script {CLUSTER_SCRIPT}")
    directory.mkdir(parents=True, exist_ok=True)
    with cluster_with_crd(directory / "cluster", namespace) as cluster:
        cluster.kubectl("create", "namespace", OPERATOR_NS)
        objects = _chart_rbac()  # helm: on PATH or from the test extras (e2e/cluster_tools.py)
        (account,) = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"]
        objects += _flow_schemas(account)
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        kubeconfig = cluster.token_kubeconfig(account, OPERATOR_NS, directory / "operator-kubeconfig", "6h")
        yield Bench(cluster, kubeconfig, account)


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} ([0-9.e+-]+)$")
_WRITE = {"PATCH", "APPLY", "UPDATE", "POST", "DELETE"}


def counters(metrics: str) -> dict[str, float]:
    """The operator's request counts by bucket from the API server's /metrics; ``dry-run`` is every dry-run
    request of any client (only the operator sends them here), ``rejected`` APF's rejections of the operator,
    ``md-write`` every persisted write to a ModelDeployment (status, kopf's annotations and finalizer)."""
    out: dict[str, float] = {bucket: 0.0 for bucket, _ in BUCKETS} | {"dry-run": 0.0, "rejected": 0.0, "md-write": 0.0}
    for line in metrics.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), dict(re.findall(r'(\w+)="([^"]*)"', match.group(2))), float(match[3])
        schema = labels.get("flow_schema", "")
        if name == "apiserver_flowcontrol_dispatched_requests_total" and schema.startswith("pagoda-bench-"):
            out[schema.removeprefix("pagoda-bench-")] += value
        elif name == "apiserver_flowcontrol_rejected_requests_total" and schema.startswith("pagoda-bench-"):
            out["rejected"] += value
        elif name == "apiserver_request_total" and labels.get("dry_run") == "All":
            out["dry-run"] += value
        elif name == "apiserver_request_total" and labels.get("resource") == MD_PLURAL and labels["verb"] in _WRITE:
            out["md-write"] += value  # only the operator writes ModelDeployments during a measured window
    return out


def per_minute(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: (after[k] - before[k]) * 60 / seconds for k in after}


# --- the operator process ------------------------------------------------------------------------------------


class Operator:
    """``python -m pagoda_operator.run`` as the chart runs it (Lease leader election, all namespaces), under the
    operator ServiceAccount's token; one log file across restarts."""

    def __init__(self, bench: Bench, log_path: Path, reconcile_interval: float) -> None:
        self.bench, self.log_path, self.interval = bench, log_path, reconcile_interval
        self.process: Optional[subprocess.Popen[bytes]] = None
        self.starts = 0

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": self.bench.operator_kubeconfig,
            "POD_NAME": POD_NAME,
            "PAGODA_RECONCILE_INTERVAL": str(self.interval),
        }
        command = [sys.executable, "-m", "pagoda_operator.run", f"--lease-name={RELEASE}-pagoda"]
        command += [f"--lease-namespace={OPERATOR_NS}", "--health-port=0", "--all-namespaces"]
        with open(self.log_path, "a") as out:
            out.write(f"\n===== start {self.starts + 1} at {time.strftime('%H:%M:%S')} =====\n")
            out.flush()
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a node loss would."""
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM (a rollout), SIGKILL after 20 s."""
        if self.alive():
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss_mib(self) -> float:
        """VmRSS of the operator process."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the operator process."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


async def wait_until(what: str, probe: Any, timeout: float, period: float = 1.0, say: Any = None) -> float:
    """Await ``probe()`` until truthy; the seconds it took. TimeoutError naming ``what``. ``say()``: a progress
    note logged every 15 s."""
    start = last = time.monotonic()
    while time.monotonic() - start < timeout:
        if await probe():
            return time.monotonic() - start
        if say is not None and time.monotonic() - last > 15:
            last = time.monotonic()
            log(f"waiting for {what}: {say()}")
        await asyncio.sleep(period)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


# --- what the children should be, and what they are -----------------------------------------------------------


# A spec that turns every optional child on: the kinds the builders produce for it are the kinds to look for.
EVERY_CHILD = {
    "model": {"servedModelName": "probe"},
    "loraAdapters": [{"name": "a", "source": "org/a"}],
    "autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 2, "maxReplicas": 3},
}


def desired_children(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """kind -> manifest, as the operator's pure builders make them for this body (InvalidSpec if invalid)."""
    spec, owner = parse_spec(body), Owner.from_body(body)
    built = build_children(spec, owner, include_replicas=not spec.autoscaling.enabled)
    return {kind: manifest for kind, manifest in built.items() if manifest is not None}


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str


async def child_kinds(api: Api) -> list[Kind]:
    """The child kinds the builders can produce, with their plurals from the API server's discovery."""
    probe = {"metadata": {"name": "probe", "namespace": "probe", "uid": "probe"}, "spec": EVERY_CHILD}
    kinds = []
    for manifest in desired_children(probe).values():
        version = manifest["apiVersion"]
        resources = (await api.call("GET", "/api/v1" if version == "v1" else f"/apis/{version}") or {})["resources"]
        (plural,) = [r["name"] for r in resources if r["kind"] == manifest["kind"] and "/" not in r["name"]]
        kinds.append(Kind(version, manifest["kind"], plural))
    return kinds


@dataclass
class Snapshot:
    """The ModelDeployments of a namespace and every object of a child kind carrying the operator's label."""

    mds: list[dict[str, Any]]
    children: dict[str, list[dict[str, Any]]]  # kind -> objects


async def snapshot(api: Api, kinds: list[Kind], namespace: str) -> Snapshot:
    mds = await api.list(md_path(namespace))
    children = {k.kind: await api.list(collection(k.api_version, k.plural, namespace), MANAGED_BY) for k in kinds}
    return Snapshot(mds, children)


def _norm(value: Any) -> Any:
    """Numbers as strings (quantities may come back either way); empty containers as None."""
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()} or None
    if isinstance(value, list):
        return [_norm(v) for v in value] or None
    return value if value is None or isinstance(value, (str, bool)) else str(value)


def _subset_diff(want: Any, live: Any, path: str = "") -> Optional[str]:
    """The first path where ``live`` lacks or differs from ``want`` (server defaults in ``live`` are fine)."""
    if isinstance(want, dict):
        if not isinstance(live, dict):
            return f"{path or '.'}: {live!r:.80}"
        return next((d for k, v in want.items() if (d := _subset_diff(v, live.get(k), f"{path}.{k}"))), None)
    if isinstance(want, list):
        if not isinstance(live, list) or len(live) != len(want):
            return f"{path}: {len(want)} items wanted, live {json.dumps(live)[:120]}"
        return next((d for i, (w, v) in enumerate(zip(want, live)) if (d := _subset_diff(w, v, f"{path}[{i}]"))), None)
    return None if _norm(want) == _norm(live) else f"{path}: want {want!r:.60}, live {live!r:.60}"


def _exact(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Fields that must match exactly (a field the spec no longer sets must be gone too)."""
    if kind == "Deployment":
        pod = obj["spec"]["template"]["spec"]
        engine = pod["containers"][0]
        fields = {k: engine.get(k) for k in ("args", "env", "resources")}
        fields |= {"nodeSelector": pod.get("nodeSelector"), "volumes": [v["name"] for v in pod.get("volumes") or []]}
        return {k: _norm(v) for k, v in fields.items()}
    return {"data": obj.get("data")} if kind == "ConfigMap" else {}


def _stale(kind: str, want: dict[str, Any], live: dict[str, Any]) -> Optional[str]:
    """Where ``live`` differs from the builders' ``want`` in a field the operator sets, if anywhere."""
    fields = {k: v for k, v in want.items() if k not in ("apiVersion", "kind")}  # a list's items lack them
    exact_want, exact_live = _exact(kind, want), _exact(kind, live)
    return _subset_diff(fields, live) or next(
        (
            f".{k}: want {json.dumps(v)[:150]}, live {json.dumps(exact_live[k])[:150]}"
            for k, v in exact_want.items()
            if exact_live[k] != v
        ),
        None,
    )


def check(state: Snapshot) -> list[str]:
    """Violations: a live ModelDeployment whose children are missing, duplicated, extra or stale, or whose status
    lags its generation; a child whose owner is gone (an orphan the garbage collector has not removed)."""
    problems: list[str] = []
    live = {md["metadata"]["name"]: md for md in state.mds}
    for name, md in sorted(live.items()):
        meta = md["metadata"]
        if meta.get("deletionTimestamp"):
            problems.append(f"{name}: still being deleted (finalizers {meta.get('finalizers')})")
            continue
        observed = (md.get("status") or {}).get("observedGeneration")
        if observed != meta.get("generation"):
            problems.append(f"{name}: status.observedGeneration {observed} != generation {meta.get('generation')}")
        try:
            wanted = desired_children(md)
        except InvalidSpec as error:
            problems.append(f"{name}: the benchmark wrote an invalid spec: {error}")
            continue
        for kind, objects in state.children.items():
            mine = [o for o in objects if (o["metadata"].get("labels") or {}).get(OWNER_LABEL) == name]
            want = wanted.get(kind)
            if want is None:
                problems += [f"{name}: unwanted {kind} {o['metadata']['name']}" for o in mine]
                continue
            if len(mine) != 1:
                problems.append(f"{name}: {len(mine)} {kind}s, want 1 ({[o['metadata']['name'] for o in mine]})")
                continue
            diff = _stale(kind, want, mine[0])
            if diff:
                problems.append(f"{name}: stale {kind} {diff}")
    for kind, objects in state.children.items():
        for obj in objects:
            owner = (obj["metadata"].get("labels") or {}).get(OWNER_LABEL)
            if owner not in live:
                refs = [r.get("uid", "?")[:8] for r in obj["metadata"].get("ownerReferences") or []]
                problems.append(
                    f"orphan {kind} {obj['metadata']['name']}: ModelDeployment {owner!r} is gone (ownerRefs {refs})"
                )
    return problems


class Converger:
    """Polls ``namespace`` until ``check`` finds nothing; remembers the operator's peak RSS meanwhile, and the
    problems and object counts of the last look."""

    def __init__(self, api: Api, kinds: list[Kind], operator: Operator, namespace: str) -> None:
        self.api, self.kinds, self.operator, self.namespace = api, kinds, operator, namespace
        self.peak_rss, self.problems = 0.0, ["not checked yet"]
        self.counts: dict[str, int] = {}

    async def converged(self) -> bool:
        if self.operator.alive():
            self.peak_rss = max(self.peak_rss, self.operator.rss_mib())
        state = await snapshot(self.api, self.kinds, self.namespace)
        self.problems = check(state)
        self.counts = {k: len(v) for k, v in state.children.items()} | {"ModelDeployment": len(state.mds)}
        return not self.problems

    async def wait(self, what: str, timeout: float) -> float:
        """Seconds until converged; NaN (and the problems logged) after ``timeout``."""
        try:
            say = lambda: f"{len(self.problems)} problems, e.g. {self.problems[0]}"
            return await wait_until(what, self.converged, timeout, period=2.0, say=say)
        except TimeoutError:
            log(f"{what}: not converged after {timeout:.0f} s; {len(self.problems)} problems, e.g. {self.problems[:3]}")
            return float("nan")


async def steady_state(api: Api, operator: Operator, seconds: float) -> dict[str, float]:
    """The operator's requests per minute over a quiet window, its CPU share and RSS at the end."""
    before, cpu = counters(await api.metrics()), operator.cpu_seconds()
    start = time.monotonic()
    await asyncio.sleep(seconds)
    after, elapsed = counters(await api.metrics()), time.monotonic() - start
    rates = per_minute(before, after, elapsed)
    rates["cpu %"] = 100 * (operator.cpu_seconds() - cpu) / elapsed
    rates["rss MiB"] = operator.rss_mib()
    return rates
