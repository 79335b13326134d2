"""`pagoda router` in front of real ModelDeployments: a real kube-apiserver, the operator (``kopf run``), real
`pagoda serve` processes as the pods (``StandInKubelet``: each at its own 127.0.0.N, reported Ready there) and the
router as a process watching the namespace, reached with the official ``openai`` client.

What it shows, as the issue asks: requests for two models and a LoRA adapter land on the right pods; with 2 replicas
and 16 sessions sharing long prefixes, the pods' own prefix-cache hit rate is near what sticky sessions allow and at
least twice what round-robin gets;
a model at zero replicas answers its first request with 200 once a pod is ready (the router holds it, stamps
demand, the operator's autoscaler scales to 1); SIGTERM of one pod mid-run loses no request.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from control_plane import CLUSTER_SCRIPT, Cluster, helm_template, make_stories_adapter, running, wait_for
from server_helpers import free_port
from stand_in_kubelet import StandInKubelet

from pagoda_operator.constants import DEMAND_STATUS_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CLUSTER_SCRIPT.exists(), reason="needs ../shared/k8s/cluster")]

NS = "pagoda-router"
ROUTER_NS = "pagoda-router-system"  # where the chart would run the router
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
OPERATOR_ENV = {"PAGODA_AUTOSCALE_INTERVAL": "1"}
# 179 blocks of 16 tokens (1,280 bytes a token: 5 layers, K and V, 4 heads of 8 fp32), room for about 12 of the 16
# sessions' prompts (about 15 blocks each) per pod: a pod that sees every session (round-robin) evicts many before
# they come back, a pod that sees half of them (prefix routing) keeps its half.
SMALL_KV = ["--kv-cache-memory", "3584KiB"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A PEFT adapter of the built-in model."""
    return make_stories_adapter(tmp_path_factory.mktemp("adapters") / "sql")


@pytest.fixture(scope="module")
def kubelet(cluster: Cluster, tmp_path_factory) -> Iterator[StandInKubelet]:
    stand_in = StandInKubelet(cluster, tmp_path_factory.mktemp("pods"))
    try:
        yield stand_in
    finally:
        stand_in.stop()


@pytest.fixture(scope="module")
def models(cluster: Cluster, operator, kubelet: StandInKubelet, adapter: Path) -> dict[str, list[str]]:
    """alpha (2 replicas, a small KV cache), beta (1 replica, LoRA adapter sql), zero (autoscaled from 0): the pod
    names of each once they run."""
    cluster.apply_md("alpha", replicas=2, engine={"extraArgs": SMALL_KV})
    cluster.apply_md("beta", replicas=1, loraAdapters=[{"name": "sql", "source": str(adapter)}])
    scaling = {"enabled": True, "mode": "builtin", "minReplicas": 0, "maxReplicas": 1}
    cluster.apply_md("zero", autoscaling={**scaling, "scaleDownStabilizationSeconds": 600})
    pods: dict[str, list[str]] = {}
    for md, count in (("alpha", 2), ("beta", 1)):
        wait_for(f"{count} pods of {md}", lambda md=md, count=count: len(cluster.pods_of(md)) == count, 60)
        kubelet.sync(md)
        pods[md] = sorted(p["metadata"]["name"] for p in cluster.pods_of(md))
    return pods


def router_kubeconfig(cluster: Cluster, directory: Path) -> str:
    """A kubeconfig of the router's own ServiceAccount, bound by the chart's router RBAC (a Role in the watched
    namespace): the router must work with exactly what the chart grants."""
    objects = helm_template("pagoda", ROUTER_NS, "router.enabled=true", f"operator.watchNamespaces={{{NS}}}")
    router_rbac = [o for o in objects if o["kind"] in RBAC_KINDS and "router" in o["metadata"]["name"]]
    assert {o["kind"] for o in router_rbac} == {"ServiceAccount", "Role", "RoleBinding"}, router_rbac
    cluster.kubectl("create", "namespace", ROUTER_NS, check=False)
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": router_rbac}))
    (account,) = [o["metadata"]["name"] for o in router_rbac if o["kind"] == "ServiceAccount"]
    return cluster.token_kubeconfig(account, ROUTER_NS, directory / "kubeconfig")


@pytest.fixture(scope="module")
def router(cluster: Cluster, models, tmp_path_factory) -> Iterator[str]:
    """The router watching the namespace with the chart's RBAC; yields its base URL once it knows alpha and beta."""
    port = free_port()
    directory = tmp_path_factory.mktemp("router")
    env = {**os.environ, "KUBECONFIG": router_kubeconfig(cluster, directory)}
    command = [sys.executable, "-m", "pagoda_operator.router", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--namespace", NS, "--hold-timeout", "150"]
    log = directory / "router.log"
    with running(command, env, log):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

        def known() -> bool:
            try:
                return {"alpha", "beta", "sql"} <= {m.id for m in client.models.list()}
            except openai.APIError:
                return False

        wait_for("the router to know alpha, beta and sql", known, 60)
        yield f"http://127.0.0.1:{port}/v1"
        assert not re.search(r"forbidden", log.read_text(), re.IGNORECASE), log.read_text()[-3000:]


def _status(cluster: Cluster, md: str) -> dict[str, Any]:
    return (cluster.get("modeldeployment", md, NS) or {}).get("status") or {}


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=180)


def successes(kubelet: StandInKubelet, pod: str) -> float:
    return kubelet.metric(pod, "vllm:request_success_total")


def test_each_model_and_adapter_lands_on_its_own_pods(router, models, kubelet) -> None:
    client = client_of(router)
    before = {pod: successes(kubelet, pod) for pods in models.values() for pod in pods}
    for model, count in (("alpha", 4), ("beta", 3), ("sql", 2)):
        for _ in range(count):
            reply = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
            assert reply.model == model and reply.choices[0].text
    stream = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    gained = {pod: successes(kubelet, pod) - before[pod] for pod in before}
    assert sum(gained[p] for p in models["alpha"]) == 4
    assert sum(gained[p] for p in models["beta"]) == 3 + 2 + 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def _session_prompts(seed: int, sessions: int = 16, turns: int = 4) -> list[list[str]]:
    """Per round, the prompt of every session (in a shuffled order): a long prefix of its own, then its turns."""
    rng = random.Random(seed)
    words = ["dragon", "castle", "river", "forest", "little", "happy", "girl", "boy", "sun", "tree", "cat", "dog"]
    prefixes = [" ".join(rng.choice(words) for _ in range(90)) for _ in range(sessions)]
    rounds = []
    for turn in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        rounds.append([prefixes[s] + "".join(f" Q{t}: tell me more." for t in range(turn + 1)) for s in order])
    return rounds


def _hit_rate(kubelet: StandInKubelet, pods: list[str], run) -> float:
    def totals() -> tuple[float, float]:
        hits = sum(kubelet.metric(p, "vllm:prefix_cache_hits_total") for p in pods)
        return hits, sum(kubelet.metric(p, "vllm:prefix_cache_queries_total") for p in pods)

    hits_before, queries_before = totals()
    prompt_tokens = run()
    # The engines add a request's lookup to their counters as it is admitted: wait until all of them are in.
    wait_for("the pods to count every lookup", lambda: totals()[1] - queries_before >= prompt_tokens, 30)
    hits, queries = totals()
    return (hits - hits_before) / (queries - queries_before)


def _run_rounds(rounds: list[list[str]], client_for) -> int:
    """Each round's prompts, four at a time; the prompt tokens sent."""
    prompt_tokens = 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for index, prompts in enumerate(rounds):
            jobs = [
                pool.submit(
                    client_for(index * len(prompts) + i).completions.create, model="alpha", prompt=p, max_tokens=2
                )
                for i, p in enumerate(prompts)
            ]
            prompt_tokens += sum(job.result().usage.prompt_tokens for job in jobs)
    return prompt_tokens


def test_prefix_routing_keeps_sessions_on_the_pod_that_cached_them(router, models, kubelet) -> None:
    pods = models["alpha"]
    direct = [client_of(f"http://{kubelet.ips[p]}:8000/v1") for p in pods]
    routed = client_of(router)
    round_robin = _hit_rate(kubelet, pods, lambda: _run_rounds(_session_prompts(1), lambda i: direct[i % 2]))
    served = [successes(kubelet, pod) for pod in pods]
    by_router = _hit_rate(kubelet, pods, lambda: _run_rounds(_session_prompts(2), lambda i: routed))
    split = [successes(kubelet, pod) - before for pod, before in zip(pods, served)]
    state = _router_get(router, "/debug/endpoints")
    print(f"prefix-cache hit rate: round-robin {round_robin:.3f}, router {by_router:.3f}; requests per pod {split}")
    # Sticky routing serves every later turn from cache: (tokens of turns 2-4 before their new question) / all
    # tokens is about 0.72 here. Round-robin over a shuffled order sends a session's next turn to the pod of its
    # previous turn only half of the time, and its misses (whole prompts) evict what that pod held for others.
    assert by_router >= 0.6, (by_router, split, state)
    assert by_router >= 2 * round_robin, (round_robin, by_router, split, state)


def _router_get(router: str, path: str) -> Any:
    with urllib.request.urlopen(router.removesuffix("/v1") + path, timeout=10) as reply:
        return json.load(reply)


def test_a_model_at_zero_replicas_answers_its_first_request_once_a_pod_is_ready(cluster, router, kubelet) -> None:
    assert cluster.get("deployment", "zero", NS)["spec"].get("replicas") == 0
    client = client_of(router)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(client.completions.create, model="zero", prompt="Once upon a time", max_tokens=4)
        wait_for("the router's demand stamp", lambda: _status(cluster, "zero").get(DEMAND_STATUS_FIELD), 30)
        wait_for("the autoscaler to scale zero to 1", lambda: cluster.pods_of("zero"), 60)
        assert not reply.done()  # held, not refused
        kubelet.sync("zero")
        assert reply.result(timeout=120).choices[0].text
    shown = cluster.kubectl("get", "deployment", "zero", "-n", NS, "-o", "json", "--show-managed-fields")
    deployment = json.loads(shown.stdout)
    assert deployment["spec"]["replicas"] == 1
    fields = deployment["metadata"]["managedFields"]
    managers = {m["manager"] for m in fields if "f:replicas" in m.get("fieldsV1", {}).get("f:spec", {})}
    assert managers == {"pagoda-autoscaler"}, managers  # the router never wrote replicas


def test_sigterm_of_one_pod_mid_run_loses_no_request(router, models, kubelet) -> None:
    client = client_of(router)
    victim = models["alpha"][0]

    def ask(i: int) -> Any:
        return client.completions.create(model="alpha", prompt=f"Story number {i}:", max_tokens=24)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(ask, i) for i in range(48)]
        wait_for("a few requests to finish", lambda: sum(j.done() for j in jobs) >= 8, 60)
        kubelet.terminate(victim)
        time.sleep(1.0)  # the readiness probe notices the drain a moment later
        kubelet.report(victim, ready=False)
        results = [job.result(timeout=120) for job in jobs]
    assert all(r.choices[0].text is not None and r.usage.completion_tokens > 0 for r in results)
