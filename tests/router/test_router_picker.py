"""How the picker places requests, as a specification: prefix affinity first, bounded by load, then spreading.

The rule (see pagoda_operator/router/picker.py): drop candidates more than ``load_threshold`` busier than the least
loaded one; of the rest take the longest prefix match; ties go to the least loaded, then to a rendezvous hash of the
request's first chunk.
"""

from __future__ import annotations

from collections import Counter

import pytest

from pagoda_operator.router.endpoints import Endpoint, EndpointLoad
from pagoda_operator.router.picker import Picker

PODS = [Endpoint(key=f"ns/pod-{i}", url=f"http://10.0.0.{i}:8000") for i in range(4)]


def conversation(session: int, turns: int) -> str:
    """A chat's canonical text after ``turns`` turns: each turn appends to the one before (about 600 chars each)."""
    head = f"system: session {session} is a long-running chat about topic {session * 7919}. "
    return head + "".join(f"user: question {t} of session {session}. " * 12 for t in range(turns))


def send(picker: Picker, pods: list[Endpoint], text: str, *, finish: bool = True, **pick: object) -> Endpoint:
    chosen = picker.pick(pods, text, **pick)  # type: ignore[arg-type]
    assert chosen is not None
    picker.started(chosen, text)
    if finish:
        picker.finished(chosen)
    return chosen


def idle(picker: Picker, pods: list[Endpoint], **load: object) -> None:
    for pod in pods:
        picker.update_load(pod.key, EndpointLoad(**load))  # type: ignore[arg-type]


def test_a_session_sticks_to_the_endpoint_that_served_its_first_turn() -> None:
    picker = Picker()
    homes = {}
    for turn in range(1, 6):
        for session in range(8):  # interleaved sessions
            chosen = send(picker, PODS[:3], conversation(session, turn))
            assert homes.setdefault(session, chosen) == chosen, f"session {session} moved at turn {turn}"


def test_an_endpoint_within_the_threshold_keeps_its_sessions_one_beyond_it_loses_them() -> None:
    picker = Picker(load_threshold=4.0)
    pods = PODS[:2]
    home = send(picker, pods, conversation(1, 1))
    other = next(pod for pod in pods if pod != home)
    # four requests still in flight on the sticky endpoint: 4 - 0 is not more than the threshold
    for _ in range(4):
        send(picker, pods, conversation(1, 1), finish=False)
    assert picker.pick(pods, conversation(1, 2)) == home
    # a fifth one: the sticky endpoint is 5 requests busier than the idle one, so the next turn goes there
    picker.started(home, conversation(1, 1))
    assert picker.pick(pods, conversation(1, 2)) == other
    # once they finish the session comes back home
    for _ in range(5):
        picker.finished(home)
    assert picker.pick(pods, conversation(1, 2)) == home


def test_scraped_queues_count_as_load_too() -> None:
    picker = Picker(load_threshold=4.0)
    pods = PODS[:2]
    idle(picker, pods)
    home = send(picker, pods, conversation(3, 1))
    other = next(pod for pod in pods if pod != home)
    picker.update_load(home.key, EndpointLoad(running=3.0))
    assert picker.pick(pods, conversation(3, 2)) == home
    picker.update_load(home.key, EndpointLoad(running=3.0, waiting=1.0))  # waiting counts twice: 5 > 4
    assert picker.pick(pods, conversation(3, 2)) == other
    picker.update_load(home.key, EndpointLoad(running=1.0, kv_usage=0.9))  # 1 + 4 * 0.9 = 4.6 > 4
    assert picker.pick(pods, conversation(3, 2)) == other


def test_an_overloaded_best_match_falls_back_to_the_best_match_within_the_threshold() -> None:
    picker = Picker(load_threshold=4.0)
    pods = PODS[:3]
    text = conversation(5, 4)
    # pod-0 holds the whole conversation, pod-1 its first turn, pod-2 nothing
    picker.started(pods[0], text)
    picker.started(pods[1], conversation(5, 1))
    picker.finished(pods[0])
    picker.finished(pods[1])
    picker.update_load(pods[0].key, EndpointLoad(running=9.0))
    picker.update_load(pods[1].key, EndpointLoad(running=2.0))
    picker.update_load(pods[2].key, EndpointLoad())
    assert picker.pick(pods, text) == pods[1]  # not the least loaded pod-2: pod-1 still holds a prefix
    picker.update_load(pods[0].key, EndpointLoad(running=4.0))
    assert picker.pick(pods, text) == pods[0]


def test_an_endpoint_whose_scrape_failed_counts_as_loaded_not_idle() -> None:
    picker = Picker(load_threshold=4.0)
    pods = PODS[:2]
    idle(picker, pods)
    home = send(picker, pods, conversation(9, 1))
    other = next(pod for pod in pods if pod != home)
    picker.update_load(home.key, None)
    assert picker.pick(pods, conversation(9, 2)) == other
    assert all(picker.pick(pods, conversation(s, 1)) == other for s in range(20, 30))  # new sessions too
    assert picker.explain()[home.key]["load_known"] is False
    # when every scrape fails the picker still routes, by prefix
    picker.update_load(other.key, None)
    assert picker.pick(pods, conversation(9, 2)) == home


def test_never_scraped_endpoints_are_weighed_by_their_in_flight_requests_only() -> None:
    picker = Picker()
    assert picker.load_of("ns/new") == 0.0
    picker.started(PODS[0], "x")
    assert picker.load_of(PODS[0].key) == 1.0


def test_excluded_endpoints_are_never_chosen() -> None:
    picker = Picker()
    pods = PODS[:3]
    home = send(picker, pods, conversation(2, 1))
    retry = picker.pick(pods, conversation(2, 2), exclude={home.key})
    assert retry is not None and retry != home
    assert picker.pick(pods, conversation(2, 2), exclude={home.key, retry.key}) not in (home, retry, None)
    assert picker.pick(pods, conversation(2, 2), exclude={pod.key for pod in pods}) is None
    assert picker.pick([], "anything") is None


def test_an_endpoint_running_the_adapter_is_preferred_but_not_at_any_cost() -> None:
    picker = Picker()
    pods = PODS[:2]
    picker.update_load(pods[0].key, EndpointLoad())
    picker.update_load(pods[1].key, EndpointLoad(loras=frozenset({"sql"})))
    assert {picker.pick(pods, conversation(s, 1), lora="sql") for s in range(12)} == {pods[1]}
    # other adapters, or none, spread as usual
    assert {picker.pick(pods, conversation(s, 1), lora="chat") for s in range(12)} == set(pods)
    # a preference, not a rule: two requests busier, the adapter's endpoint loses a new session
    picker.update_load(pods[1].key, EndpointLoad(running=2.0, loras=frozenset({"sql"})))
    assert picker.pick(pods, conversation(1, 1), lora="sql") == pods[0]


@pytest.mark.parametrize(
    "endpoints, sessions, low, high", [(2, 16, 6, 10), (3, 30, 7, 13), (4, 40, 7, 13), (4, 200, 40, 60)]
)
def test_distinct_sessions_spread_over_idle_endpoints(endpoints: int, sessions: int, low: int, high: int) -> None:
    """One request at a time (each finished before the next): only the rendezvous hash spreads them."""
    picker = Picker()
    pods = PODS[:endpoints]
    counts = Counter(send(picker, pods, conversation(s, 1)).key for s in range(sessions))
    assert len(counts) == endpoints
    assert all(low <= count <= high for count in counts.values()), counts


def test_sessions_behind_a_shared_system_prompt_share_its_holder_until_the_threshold() -> None:
    """Prefix first: the shared prompt draws new sessions to the endpoint that holds it, but only until it is more
    than the threshold busier; then the others get it too, and the sessions even out over them."""
    system = "system: you answer questions about the handbook, citing sections. " * 8  # four shared chunks
    one_at_a_time = Picker()
    assert len({send(one_at_a_time, PODS[:2], system + conversation(s, 1)).key for s in range(16)}) == 1
    concurrent = Picker(load_threshold=4.0)
    counts = Counter(send(concurrent, PODS[:2], system + conversation(s, 1), finish=False).key for s in range(16))
    assert all(6 <= count <= 10 for count in counts.values()) and len(counts) == 2, counts


def test_concurrent_new_sessions_balance_exactly() -> None:
    picker = Picker()
    counts = Counter(send(picker, PODS, conversation(s, 1), finish=False).key for s in range(16))
    assert sorted(counts.values()) == [4, 4, 4, 4]


def test_the_index_of_an_endpoint_is_bounded_by_the_chunk_budget_least_recent_first() -> None:
    picker = Picker(max_chunks_per_endpoint=10)
    pod = PODS[0]
    old, new = conversation(1, 2), conversation(2, 2)  # about 9 chunks each
    picker.started(pod, old)
    picker.started(pod, new)
    assert picker.explain()[pod.key]["indexed_chunks"] == 10
    assert picker.match(pod, picker._hashes(new)) == len(picker._hashes(new))
    assert picker.match(pod, picker._hashes(old)) == 0  # its first chunks were the least recent


def test_the_index_never_outgrows_the_endpoints_kv_capacity() -> None:
    """num_blocks * block_size tokens at 4 characters a token: 2 blocks of 16 tokens hold one 128-char chunk."""
    picker = Picker(chunk_chars=128)
    pod = PODS[0]
    picker.started(pod, conversation(1, 6))
    assert picker.explain()[pod.key]["indexed_chunks"] > 10
    picker.update_load(pod.key, EndpointLoad(block_size=16, num_blocks=2))
    assert picker.explain()[pod.key]["indexed_chunks"] == 1
    picker.started(pod, conversation(2, 3))
    assert picker.explain()[pod.key]["indexed_chunks"] == 1


def test_a_forgotten_endpoint_starts_from_nothing() -> None:
    picker = Picker()
    pod = PODS[0]
    picker.started(pod, conversation(1, 2))
    picker.update_load(pod.key, EndpointLoad(running=3.0))
    picker.forget(pod.key)
    assert pod.key not in picker.explain()
    assert picker.load_of(pod.key) == 0.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Picker(chunk_chars=0)
    with pytest.raises(ValueError):
        Picker(load_threshold=-1)
    with pytest.raises(ValueError):
        Picker(spread_slack=-0.5)


def test_a_stale_scrape_of_this_routers_own_requests_does_not_herd_new_sessions() -> None:
    """A scrape that saw this router's two requests on pod 0 is an interval old once they finished: pod 0 is idle
    again, so new sessions keep spreading instead of all going to pod 1 until the next scrape."""
    picker = Picker()
    pods = PODS[:2]
    for session in (100, 101):
        picker.started(pods[0], conversation(session, 1))
    picker.update_load(pods[0].key, EndpointLoad(running=1.0, waiting=1.0))
    picker.update_load(pods[1].key, EndpointLoad())
    assert picker.load_of(pods[0].key) > picker.load_of(pods[1].key)  # while they run, pod 0 is the busier
    picker.finished(pods[0])
    picker.finished(pods[0])
    assert picker.load_of(pods[0].key) == picker.load_of(pods[1].key) == 0.0
    counts = Counter(send(picker, pods, conversation(s, 1)).key for s in range(16))
    assert min(counts.values()) >= 6, counts
    # requests the scrape saw that were not this router's (another client's) still count
    picker.update_load(pods[0].key, EndpointLoad(running=3.0))
    assert picker.load_of(pods[0].key) == 3.0
