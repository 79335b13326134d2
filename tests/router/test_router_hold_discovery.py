"""The router's hold queue (arrival order, bound, timeout, demand stamps) and how discovery reads ModelDeployments and
pods into models (ready pods only, their URLs and KV events ports, adapters, the selector)."""

from __future__ import annotations

import asyncio
import datetime

import pytest

from pagoda_operator.router.discovery import model_of, parse_selector, pod_endpoint, utc_stamp
from pagoda_operator.router.endpoints import Endpoint
from pagoda_operator.router.hold import HoldFull, HoldQueues, HoldTimeout
from pagoda_operator.router.metrics import RouterMetrics
from pagoda_operator.router.static_models import Model, ModelTable, parse_static_models

LABELS = ("ns", "md")


def held_gauge(metrics: RouterMetrics) -> float:
    return (
        metrics.registry.get_sample_value(
            "pagoda_router_held_requests", {"model_namespace": "ns", "model_deployment": "md"}
        )
        or 0.0
    )


def test_held_requests_go_in_arrival_order_once_released() -> None:
    async def scenario() -> list[int]:
        metrics = RouterMetrics()
        queues = HoldQueues(max_held=10, timeout=5, metrics=metrics)
        order: list[int] = []

        async def request(i: int) -> None:
            await queues.wait("ns/md", LABELS)
            order.append(i)

        tasks = [asyncio.create_task(request(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert queues.held("ns/md") == 5 and held_gauge(metrics) == 5
        queues.release("ns/md")
        await asyncio.gather(*tasks)
        assert queues.held("ns/md") == 0 and held_gauge(metrics) == 0
        return order

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]


def test_a_full_queue_refuses_at_once_and_a_held_request_times_out() -> None:
    async def scenario() -> None:
        queues = HoldQueues(max_held=1, timeout=0.2)
        first = asyncio.create_task(queues.wait("ns/md", LABELS))
        await asyncio.sleep(0.01)
        with pytest.raises(HoldFull):
            await queues.wait("ns/md", LABELS)
        with pytest.raises(HoldTimeout):
            await first
        assert queues.held("ns/md") == 0

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        queues = HoldQueues(max_held=1, timeout=5)
        waiter = asyncio.create_task(queues.wait("ns/md", LABELS))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert queues.held("ns/md") == 0
        again = asyncio.create_task(queues.wait("ns/md", LABELS))  # there is room again
        await asyncio.sleep(0.01)
        queues.release("ns/md")
        await again

    asyncio.run(scenario())


def test_demand_is_stamped_while_holding_at_most_once_per_interval() -> None:
    stamps: list[str] = []

    async def on_demand(key: str) -> None:
        stamps.append(key)

    async def scenario() -> None:
        queues = HoldQueues(max_held=10, timeout=0.55, on_demand=on_demand, stamp_interval=0.2)
        results = await asyncio.gather(*(queues.wait("ns/md", LABELS) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, HoldTimeout) for r in results)

    asyncio.run(scenario())
    assert (
        stamps and set(stamps) == {"ns/md"} and 2 <= len(stamps) <= 4
    )  # about every 0.2 s, not once per request and wake


def test_a_failed_stamp_does_not_fail_the_request() -> None:
    async def on_demand(key: str) -> None:
        raise RuntimeError("API server down")

    async def scenario() -> None:
        queues = HoldQueues(max_held=10, timeout=1, on_demand=on_demand, stamp_interval=0.05)
        waiter = asyncio.create_task(queues.wait("ns/md", LABELS))
        await asyncio.sleep(0.1)
        queues.release("ns/md")
        await waiter

    asyncio.run(scenario())


def pod(name: str, ip: str, *, ready: bool = True, kv: bool = False, deleting: bool = False) -> dict:
    ports = [{"name": "http", "containerPort": 8000}]
    if kv:
        ports += [{"name": "kv-events", "containerPort": 5557}, {"name": "kv-replay", "containerPort": 5558}]
    meta = {"name": name, "namespace": "team", **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    status = {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": meta, "spec": {"containers": [{"name": "engine", "ports": ports}]}, "status": status}


MD = {
    "metadata": {"name": "llama", "namespace": "team", "creationTimestamp": "2026-12-01T10:00:00Z"},
    "spec": {"loraAdapters": [{"name": "sql", "source": "/a"}, {"name": "chat", "source": "/b"}]},
    "status": {"servedModelName": "llama-3", "selector": "app.kubernetes.io/name=pagoda,pagoda.dev/model=llama"},
}


def test_a_model_deployment_routes_to_its_ready_pods_under_its_served_name_and_adapters() -> None:
    pods = [
        pod("b", "10.0.0.2", kv=True),
        pod("a", "10.0.0.1"),
        pod("c", "10.0.0.3", ready=False),
        pod("d", "10.0.0.4", deleting=True),
    ]
    model = model_of(MD, pods, kv_events=True)
    assert model is not None and model.name == "llama-3" and model.adapters == ("sql", "chat")
    assert (model.namespace, model.deployment, model.labels) == ("team", "llama", ("team", "llama"))
    assert model.endpoints == (
        Endpoint("team/a", "http://10.0.0.1:8000"),
        Endpoint("team/b", "http://10.0.0.2:8000", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"),
    )
    assert model.created == int(datetime.datetime(2026, 12, 1, 10, tzinfo=datetime.UTC).timestamp())
    assert pod_endpoint(pod("b", "10.0.0.2", kv=True), kv_events=False).kv_events is None
    assert model_of({**MD, "status": {}}, pods, kv_events=True) is None  # not reconciled yet: not routable


def test_selectors_and_demand_stamps() -> None:
    assert parse_selector(MD["status"]["selector"]) == {"app.kubernetes.io/name": "pagoda", "pagoda.dev/model": "llama"}
    with pytest.raises(ValueError):
        parse_selector("tier in (a,b)")
    moment = datetime.datetime(2026, 12, 3, 14, 0, 5, 123, tzinfo=datetime.UTC)
    assert utc_stamp(moment) == "2026-12-03T14:00:05Z"


def test_the_table_resolves_served_names_before_adapters_and_lists_endpoints_once() -> None:
    shared = Endpoint("http://h:1", "http://h:1")
    table = ModelTable()
    changes: list[int] = []
    table.add_listener(lambda: changes.append(1))
    table.set("a", Model("a", (shared,), adapters=("b",)))
    table.set("b", Model("b", (shared,)))
    assert table.resolve("b")[0] == "b" and table.resolve("a")[2] is None  # type: ignore[index]
    assert table.resolve("nope") is None and table.endpoints() == [shared] and len(changes) == 2
    table.set("b", table.get("b"))  # type: ignore[arg-type]
    assert len(changes) == 2  # no change, no news


def test_static_files_are_checked() -> None:
    models = parse_static_models({"models": [{"name": "m", "endpoints": ["http://x:1/"], "adapters": ["l"]}]})
    assert models["m"].endpoints == (Endpoint("http://x:1", "http://x:1"),) and models["m"].adapters == ("l",)
    for bad in (
        {},
        {"models": [{"endpoints": []}]},
        {"models": [{"name": "m", "endpoints": ["x:1"]}]},
        {"models": [{"name": "m"}, {"name": "m"}]},
    ):
        with pytest.raises(ValueError):
            parse_static_models(bad)
