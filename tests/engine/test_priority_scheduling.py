"""--scheduling-policy priority (vLLM's semantics): lower priority values are admitted first (ties by arrival), memory
pressure preempts the lowest-priority running request instead of the newest one, greedy outputs do not depend on the
policy, and an fcfs engine refuses a non-zero priority with vLLM's message."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from core_helpers import check_invariants, fake_execute, make_request
from server_helpers import Server, start_server

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs, SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request_queue import PriorityQueue, priority_key
from pagoda.core.scheduler import Scheduler
from pagoda.engine.llm_engine import LLMEngine
from pagoda.metrics import EngineMetrics
from pagoda.request import RequestStatus

# The built-in model's KV bytes per 4-token block (5 layers, 4 KV heads of 8, float32, K and V).
BYTES_PER_BLOCK = 2 * 5 * 4 * 4 * 8 * 4
STORY = "Once upon a time, there was a little girl named Lily. She loved to play"


def make_scheduler(policy: str, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=64):
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, True, scheduling_policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def prioritized(priority: int, prompt=(5, 6, 7), **kwargs):
    request = make_request(list(prompt), **kwargs)
    request.priority = priority
    return request


def run_step(scheduler: Scheduler):
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, fake_execute(plan))
    check_invariants(scheduler)
    return plan


# ---- the scheduler alone -------------------------------------------------------------------


def test_admission_runs_lower_priority_values_first_and_ties_by_arrival():
    scheduler = make_scheduler("priority", max_num_seqs=2)
    requests = [prioritized(p, max_tokens=1) for p in (3, 1, 2, 1, -4)]
    for request in requests:
        scheduler.add_request(request)
    assert list(scheduler.waiting) == [requests[i] for i in (4, 1, 3, 2, 0)]
    assert scheduler.waiting.priority_counts() == {-4: 1, 1: 2, 2: 1, 3: 1}
    admitted = []
    while scheduler.has_unfinished_requests():
        waiting = set(scheduler.waiting)
        admitted += [s.request for s in run_step(scheduler).scheduled if s.request in waiting]
    assert admitted == [requests[i] for i in (4, 1, 3, 2, 0)]


def test_memory_pressure_preempts_the_lowest_priority_request_not_the_newest():
    # 4 blocks of 4: each request holds 2 full blocks, and both want a third on the next step
    outcomes = {}
    for policy in ("fcfs", "priority"):
        scheduler = make_scheduler(policy, num_blocks=4, max_model_len=16)
        low = prioritized(1, list(range(1, 9)), max_tokens=8)  # the older one: fcfs keeps it
        high = prioritized(0, list(range(20, 28)), max_tokens=8)
        later = prioritized(1, [40, 41], max_tokens=2)
        for request in (low, high, later):
            scheduler.add_request(request)
        run_step(scheduler)
        assert scheduler.running == ([low, high] if policy == "fcfs" else [high, low])  # admission order
        plan = run_step(scheduler)
        victim = low if plan.preempted_ids == [low.request_id] else high
        assert plan.preempted_ids == [victim.request_id] and victim.status == RequestStatus.PREEMPTED
        outcomes[policy] = (victim, list(scheduler.waiting))
    fcfs_victim, fcfs_waiting = outcomes["fcfs"]
    priority_victim, priority_waiting = outcomes["priority"]
    assert fcfs_victim.priority == 0 and fcfs_waiting[0] is fcfs_victim  # the newest, back at the front
    # the lowest priority, requeued by its key: ahead of the later arrival of the same priority
    assert priority_victim.priority == 1 and priority_waiting == [priority_victim, priority_waiting[1]]
    assert priority_waiting[1].prompt_token_ids == [40, 41]


def test_a_waiting_request_never_preempts_a_running_one_as_in_vllm_v1():
    scheduler = make_scheduler("priority", num_blocks=4, max_model_len=16)
    low = prioritized(5, list(range(1, 13)), max_tokens=4)  # 3 of the 4 blocks
    scheduler.add_request(low)
    run_step(scheduler)
    urgent = prioritized(-5, list(range(30, 38)), max_tokens=2)  # needs 2 blocks: only 1 is free
    scheduler.add_request(urgent)
    plan = run_step(scheduler)
    assert not plan.preempted_ids and [s.request for s in plan.scheduled] == [low]
    while low.status == RequestStatus.RUNNING:
        run_step(scheduler)
    assert low.num_preemptions == 0 and run_step(scheduler).scheduled[0].request is urgent


def test_priority_queue_removes_and_requeues_in_any_order():
    queue, rng = PriorityQueue(), random.Random(0)
    requests = [prioritized(rng.randrange(-3, 4)) for _ in range(200)]
    queued: set = set()
    for _ in range(2000):
        request = rng.choice(requests)
        if request in queued and rng.random() < 0.5:
            queue.remove(request)
            queued.discard(request)
        elif request not in queued:
            queue.add(request)
            queued.add(request)
        if queued and rng.random() < 0.2:
            expected = min(queued, key=priority_key)
            assert queue.peek() is expected and queue.pop() is expected
            queued.discard(expected)
        assert len(queue) == len(queued)
    assert list(queue) == sorted(queued, key=priority_key)
    assert len(queue._heap) <= 2 * len(queued) + 65  # removed entries do not pile up


@pytest.mark.parametrize("seed", range(3))
def test_mixed_load_under_pressure_admits_in_priority_order_and_leaks_nothing(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler("priority", num_blocks=24, max_num_seqs=6, budget=24)
    for step in range(400):
        if step < 150 and rng.random() < 0.4:
            prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 20))]
            n = rng.choice((1, 1, 1, 2, 3))
            scheduler.add_request(prioritized(rng.randrange(-2, 3), prompt, max_tokens=rng.randrange(1, 24), n=n))
        if scheduler.running and rng.random() < 0.05:
            scheduler.finish_requests([rng.choice(scheduler.running).request_id], RequestStatus.FINISHED_ABORTED)
        before = {r.request_id for r in scheduler.waiting}
        plan = run_step(scheduler)
        admitted = [s.request for s in plan.scheduled if s.request.request_id in before]
        if admitted and scheduler.waiting:  # what was admitted comes before everything still waiting
            assert max(map(priority_key, admitted)) <= min(map(priority_key, scheduler.waiting))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv.pool.num_free_blocks == 24 and not scheduler.requests
    assert scheduler.num_preemptions_total > 0  # the load did put the blocks under pressure


# ---- the engine with the built-in model ------------------------------------------------------


def test_fcfs_refuses_a_priority_as_vllm_does():
    llm = LLM(max_model_len=128)
    engine = llm.engine
    with pytest.raises(ValueError, match=r"^Got priority 3 but Priority scheduling is not enabled\.$"):
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2), priority=3)
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, -1])
    assert not engine.has_unfinished_requests() and not engine.output_processor.states  # nothing left behind
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2), priority=0)
    engine.abort_request("b")
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        EngineArgs(scheduling_policy="lifo").validate()


def test_engine_admits_by_priority_and_reports_it_in_its_stats():
    engine = LLMEngine(EngineArgs(max_model_len=128, max_num_seqs=1, scheduling_policy="priority"))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request("bad", [5, 6], params, priority=True)
    requests = [engine.add_request(f"r{i}", [5, 6, 7 + i], params, priority=p) for i, p in enumerate((2, 0, 5, 0))]
    stats = engine.get_stats()
    assert stats.waiting_by_priority == ((0, 2), (2, 1), (5, 1)) and stats.running_by_priority == ()
    engine.step()
    assert engine.get_stats().running_by_priority == ((0, 1),)
    while engine.has_unfinished_requests():
        engine.step()
    order = sorted(requests, key=lambda r: r.first_scheduled_time)
    assert [r.external_id for r in order] == ["r1", "r3", "r0", "r2"]


def test_under_memory_pressure_the_low_priority_request_is_recomputed_and_outputs_match_fcfs():
    """24 blocks of 4 tokens; two 60-token sequences need 30. fcfs preempts the newer (high-priority) one, priority
    the older low-priority one; the greedy tokens are the same either way (and with every priority in one LLM)."""
    llm_fcfs = LLM(max_model_len=64, block_size=4, enable_prefix_caching=False, kv_cache_memory=24 * BYTES_PER_BLOCK)
    llm_priority = LLM(
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,
        kv_cache_memory=24 * BYTES_PER_BLOCK,
        scheduling_policy="priority",
    )
    prompts = [llm_fcfs.get_tokenizer().encode(STORY + ending) for ending in (" Tim", " Sue")]
    params = SamplingParams(temperature=0.0, max_tokens=60 - max(map(len, prompts)), ignore_eos=True)
    results = {}
    for name, llm, priorities in (("fcfs", llm_fcfs, (0, 0)), ("priority", llm_priority, (1, 0))):
        engine = llm.engine
        old, new = (
            engine.add_request(f"{name}{i}", p, params, priority=q) for i, p, q in zip((0, 1), prompts, priorities)
        )
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        results[name] = ([outputs[f"{name}0"], outputs[f"{name}1"]], old.num_preemptions, new.num_preemptions)
    (fcfs_tokens, fcfs_old, fcfs_new), (priority_tokens, priority_old, priority_new) = results.values()
    assert fcfs_old == 0 and fcfs_new > 0  # fcfs: the newest goes
    assert priority_old > 0 and priority_new == 0  # priority: the lowest priority goes, though it is the older
    assert priority_tokens == fcfs_tokens and all(len(t) == params.max_tokens for t in fcfs_tokens)
    offline = llm_priority.generate(prompts, params, use_tqdm=False, priority=[7, -7])
    assert [o.outputs[0].token_ids for o in offline] == fcfs_tokens
    with pytest.raises(ValueError, match="The lengths of prompts and priority must be the same"):
        llm_priority.generate(prompts, params, use_tqdm=False, priority=[1])


def test_metrics_count_requests_by_bucketed_priority():
    engine = LLMEngine(EngineArgs(max_model_len=128, max_num_seqs=1, scheduling_policy="priority"))
    for i, priority in enumerate((-9, -1, 0, 1, 2, 40)):
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2), priority=priority)
    engine.step()  # admits r0 (priority -9)
    metrics = EngineMetrics("m", block_size=16, num_blocks=64)
    metrics.record_step(engine.get_stats(), 0)

    def gauge(which: str, label: str) -> float:
        return metrics.registry.get_sample_value(
            f"pagoda:num_requests_{which}_by_priority", {"model_name": "m", "priority": label}
        )

    waiting = {label: gauge("waiting", label) for label in ("<-1", "-1", "0", "1", ">1")}
    running = {label: gauge("running", label) for label in ("<-1", "0")}
    assert waiting == {"<-1": 0, "-1": 1, "0": 1, "1": 1, ">1": 2} and running == {"<-1": 1, "0": 0}
    text = metrics.render()[0].decode()
    assert text.count("pagoda:num_requests_waiting_by_priority{") == 5  # five label values, whatever the priorities


# ---- a real server ---------------------------------------------------------------------------


SERVER_FLAGS = ("--max-model-len", "512", "--tokenizer-pool-type", "thread")


@pytest.fixture(scope="module")
def servers():
    """(a priority server running one sequence at a time, an fcfs server), started side by side."""
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(start_server, "--scheduling-policy", "priority", "--max-num-seqs", "1", *SERVER_FLAGS),
            pool.submit(start_server, *SERVER_FLAGS),
        ]
        started = [future.result() for future in starting]
    yield started
    for server in started:
        server.stop()


def _waiting_by_priority(server: Server) -> dict[str, float]:
    _, _, text = server.request("GET", "/metrics")
    prefix = "pagoda:num_requests_waiting_by_priority{"
    lines = [line for line in str(text).splitlines() if line.startswith(prefix)]
    return {line.split('priority="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_server_admits_a_later_higher_priority_request_first(servers):
    """One sequence at a time: while streamed blockers run, a low-priority request queues, then a high-priority
    one (/metrics shows both, by their priority buckets); the blockers' clients leave, and the high-priority request
    is admitted (and done) first."""
    priority_server = servers[0]
    client = openai.OpenAI(base_url=priority_server.base_url, api_key="unused", max_retries=0)
    done: dict[str, float] = {}

    def complete(name: str, priority: int) -> str:
        extra = {"priority": priority, "ignore_eos": True}
        result = client.completions.create(
            model="stories260K", prompt="Once upon a time", max_tokens=16, temperature=0, extra_body=extra
        )
        done[name] = time.monotonic()
        return result.choices[0].text

    # Three blockers of 480 tokens, run one after the other: a window of 1440 steps, however fast the engine is.
    extra = {"priority": -5, "ignore_eos": True}
    blockers = [
        client.completions.create(model="stories260K", prompt="Once", max_tokens=480, stream=True, extra_body=extra)
        for _ in range(3)
    ]
    with ThreadPoolExecutor(2) as pool:
        next(iter(blockers[0]))  # running: the others wait behind it
        low = pool.submit(complete, "low", 5)
        _wait_for(lambda: _waiting_by_priority(priority_server).get(">1") == 1, "the low-priority request to queue")
        high = pool.submit(complete, "high", -1)
        _wait_for(
            lambda: (lambda w: w["-1"] == w[">1"] == 1 and w["<-1"] >= 1)(_waiting_by_priority(priority_server)),
            "both requests to wait behind the blockers",
        )
        for blocker in blockers:  # the clients leave: the engine aborts the blockers and admits the next request
            blocker.close()
        assert low.result() and high.result()
    assert done["high"] < done["low"]


def test_an_fcfs_server_refuses_a_priority_with_a_400(servers):
    client = openai.OpenAI(base_url=servers[1].base_url, api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model="stories260K", prompt="Once", max_tokens=2, stream=stream, extra_body={"priority": 3}
            )
        assert refused.value.status_code == 400
        assert "Got priority 3 but Priority scheduling is not enabled." in refused.value.message
    ok = client.completions.create(model="stories260K", prompt="Once", max_tokens=2, extra_body={"priority": 0})
    assert ok.choices[0].finish_reason == "length"
