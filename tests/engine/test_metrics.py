"""The /metrics exposition: vLLM's names, and values that agree with what a real engine did."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda import LLM, RequestOutputKind, SamplingParams
from pagoda.engine.llm_engine import EngineStats
from pagoda.metrics import EngineMetrics, build_1_2_5_buckets
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "stories260K"
DELTA, FINAL_ONLY, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE
SHARED_PREFIX = [(7 * i) % 480 + 10 for i in range(48)]  # three full 16-token blocks
EXPOSED = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
    "vllm:iteration_tokens_total_count",
    "vllm:cache_config_info",
}


def scrape(metrics: EngineMetrics) -> dict[tuple[str, frozenset], float]:
    """Every exposed sample as {(sample name, its labels without model_name): value}; asserts the
    model_name label is on every sample."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == metrics.model_name, sample
            samples[(sample.name, frozenset(labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256)


@dataclass
class Expected:
    """What the test itself saw, to hold the metrics against."""

    generated: int = 0
    finished: list[RequestOutput] = field(default_factory=list)
    generated_by_finished: int = 0
    completions_with_tokens: set = field(default_factory=set)
    batched_tokens: list[int] = field(default_factory=list)


def first_generated_token(llm: LLM, prompt: list[int]) -> tuple[int, int]:
    """(token id, its 1-based position) of a greedy token that first occurs after the first one."""
    tokens = (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0].token_ids
    )
    for position, token in enumerate(tokens):
        if position > 0 and token not in tokens[:position]:
            return token, position + 1
    pytest.skip("greedy output repeats a single token")


def run_engine(llm: LLM, metrics: EngineMetrics) -> tuple[Expected, dict, EngineStats]:
    """Serve a mix of requests step by step, feeding the metrics as a server would; returns what was
    seen, a scrape taken mid-run, and the engine's stats at that scrape."""
    engine = llm.engine
    stop_prompt = [300 + i for i in range(9)]
    stop_token, stop_after = first_generated_token(llm, stop_prompt)
    kinds: dict[str, RequestOutputKind] = {}

    def add(request_id: str, prompt: list[int], kind: RequestOutputKind, **params) -> None:
        kinds[request_id] = kind
        engine.add_request(request_id, prompt, SamplingParams(output_kind=kind, **params))

    greedy = dict(temperature=0, ignore_eos=True)
    add("first", SHARED_PREFIX + [20, 21, 22], DELTA, max_tokens=12, **greedy)
    add("aborted", [40 + i for i in range(20)], FINAL_ONLY, max_tokens=50, **greedy)
    add("parallel", [60 + i for i in range(11)], DELTA, n=2, seed=3, max_tokens=9, ignore_eos=True)
    seen = Expected()
    mid_scrape, mid_stats, step = None, None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step += 1
        stats = engine.get_stats()
        metrics.record_step(stats, engine.last_step_num_tokens)
        seen.batched_tokens.append(engine.last_step_num_tokens)
        for output in outputs:
            observe(seen, output, kinds[output.request_id])
            metrics.record_output(output, time.monotonic(), kinds[output.request_id])
        if step == 2:  # the shared prefix is cached by now
            add("second", SHARED_PREFIX + [30, 31], FINAL_ONLY, max_tokens=6, **greedy)
            add("stopped", stop_prompt, CUMULATIVE, temperature=0, max_tokens=10, stop_token_ids=[stop_token])
        if step == 4:
            engine.abort_request("aborted")
            metrics.record_abort("aborted")
            mid_scrape, mid_stats = scrape(metrics), stats
    metrics.record_step(engine.get_stats(), 0)  # the idle engine, as the server's last refresh would see it
    stopped = next(o for o in seen.finished if o.request_id == "stopped")
    assert len(stopped.outputs[0].token_ids) == stop_after
    return seen, mid_scrape, mid_stats


def observe(seen: Expected, output: RequestOutput, kind: RequestOutputKind) -> None:
    for completion in output.outputs:
        if completion.token_ids:
            seen.completions_with_tokens.add((output.request_id, completion.index))
    # DELTA outputs carry new tokens; CUMULATIVE/FINAL_ONLY ones are complete once finished
    if kind == DELTA or output.finished:
        new = sum(len(c.token_ids) for c in output.outputs)
        seen.generated += new
        seen.generated_by_finished += new
    if output.finished:
        seen.finished.append(output)


def test_metrics_agree_with_a_real_engine(llm: LLM) -> None:
    stats0 = llm.engine.get_stats()
    metrics = EngineMetrics(MODEL, stats0.block_size, stats0.num_blocks, max_model_len=256)
    started = time.monotonic()
    seen, mid, mid_stats = run_engine(llm, metrics)
    elapsed = time.monotonic() - started
    final = llm.engine.get_stats()
    samples = scrape(metrics)

    assert {name for name, _ in samples} >= EXPOSED
    assert not [name for name, _ in samples if name.endswith("_created")]
    assert (
        value(samples, "vllm:cache_config_info", block_size=str(final.block_size), num_gpu_blocks=str(final.num_blocks))
        == 1
    )

    # gauges: exactly the engine's at the scrape; the KV cache is empty once the engine is idle
    assert value(mid, "vllm:num_requests_running") == mid_stats.num_running > 0
    assert value(mid, "vllm:num_requests_waiting") == mid_stats.num_waiting
    assert value(mid, "vllm:kv_cache_usage_perc") == pytest.approx(mid_stats.kv_cache_usage)
    assert 0 < mid_stats.kv_cache_usage <= 1
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0

    # engine counters are mirrored, prefix sharing included
    assert final.prefix_cache_hits >= len(SHARED_PREFIX)
    assert value(samples, "vllm:prefix_cache_hits_total") == final.prefix_cache_hits
    assert value(samples, "vllm:prefix_cache_queries_total") == final.prefix_cache_queries
    assert value(samples, "vllm:num_preemptions_total") == final.num_preemptions
    assert value(samples, "vllm:iteration_tokens_total_count") == sum(1 for n in seen.batched_tokens if n > 0)
    assert value(samples, "vllm:iteration_tokens_total_sum") == sum(seen.batched_tokens)

    # tokens: every delivered token once; prompts of finished requests
    assert seen.generated == 12 + 2 * 9 + 6 + len(
        next(o for o in seen.finished if o.request_id == "stopped").outputs[0].token_ids
    )
    assert value(samples, "vllm:generation_tokens_total") == seen.generated
    finished = seen.finished
    assert sorted(o.request_id for o in finished) == ["first", "parallel", "second", "stopped"]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finished)
    assert value(samples, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(samples, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(samples, "vllm:request_prompt_tokens_count") == len(finished)
    assert value(samples, "vllm:request_generation_tokens_sum") == seen.generated_by_finished
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 3
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1

    # latencies of finished requests, from the engine's own timestamps
    ttft = sum(o.metrics.first_token_time - o.metrics.arrival_time for o in finished)
    assert value(samples, "vllm:time_to_first_token_seconds_count") == len(finished)
    assert value(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(ttft)
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == len(finished)
    e2e = sum(o.metrics.finished_time - o.metrics.arrival_time for o in finished)
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(e2e)
    assert 0 < e2e <= len(finished) * elapsed
    queue = sum(o.metrics.first_scheduled_time - o.metrics.arrival_time for o in finished)
    assert value(samples, "vllm:request_queue_time_seconds_sum") == pytest.approx(queue)
    # every token but a completion's first has an inter-token latency, all within the run
    itl_count = value(samples, "vllm:inter_token_latency_seconds_count")
    assert itl_count == seen.generated - len(seen.completions_with_tokens)
    assert 0 < value(samples, "vllm:inter_token_latency_seconds_sum") <= elapsed * len(seen.completions_with_tokens)


def stats(queries: int, hits: int, preemptions: int, running: int = 1) -> EngineStats:
    return EngineStats(running, 0, 0.5, queries, hits, preemptions, 0, num_blocks=64, block_size=16)


def test_counters_advance_by_engine_deltas_and_never_decrease() -> None:
    metrics = EngineMetrics("m", block_size=16, num_blocks=64)
    metrics.record_step(stats(10, 4, 0), num_batched_tokens=10)
    metrics.record_step(stats(25, 4, 1), num_batched_tokens=3)
    metrics.record_step(stats(25, 4, 1), num_batched_tokens=0)  # an idle refresh observes no iteration
    assert value(scrape(metrics), "vllm:prefix_cache_queries_total") == 25
    metrics.record_step(stats(5, 0, 0), num_batched_tokens=5)  # a restarted engine counts from zero again
    metrics.record_step(stats(8, 2, 0), num_batched_tokens=1)
    samples = scrape(metrics)
    assert value(samples, "vllm:prefix_cache_queries_total") == 28
    assert value(samples, "vllm:prefix_cache_hits_total") == 6
    assert value(samples, "vllm:num_preemptions_total") == 1
    assert value(samples, "vllm:iteration_tokens_total_count") == 4
    assert value(samples, "vllm:iteration_tokens_total_sum") == 19


def synthetic(tokens: list[int], first: float, last: float, finished: bool, reason: str = "length") -> RequestOutput:
    times = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.25, first_token_time=first, last_token_time=last)
    times.finished_time = last + 0.5 if finished else None
    completion = CompletionOutput(0, "", tokens, finish_reason=reason if finished else None)
    return RequestOutput("r", None, [1, 2, 3], [completion], finished, times)


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_inter_token_latency_spreads_a_gap_over_the_tokens_that_arrived_together(kind: RequestOutputKind) -> None:
    metrics = EngineMetrics("m", block_size=16, num_blocks=64)
    metrics.record_output(synthetic([5], 1.0, 1.0, False), 9.0, kind)
    later = [6, 7, 8] if kind == DELTA else [5, 6, 7, 8]
    metrics.record_output(synthetic(later, 1.0, 1.75, True), 9.0, kind)
    samples = scrape(metrics)
    assert value(samples, "vllm:generation_tokens_total") == 4
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 3
    assert value(samples, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.75)
    assert value(samples, "vllm:inter_token_latency_seconds_bucket", le="0.2") == 0
    assert value(samples, "vllm:inter_token_latency_seconds_bucket", le="0.3") == 3
    assert value(samples, "vllm:request_generation_tokens_sum") == 4
    assert value(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(samples, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(2.25)
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1


def test_a_final_only_output_spreads_decode_time_over_its_later_tokens() -> None:
    metrics = EngineMetrics("m", block_size=16, num_blocks=64)
    metrics.record_output(synthetic([5, 6, 7, 8, 9], 1.0, 2.0, True, reason="stop"), 9.0, FINAL_ONLY)
    samples = scrape(metrics)
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 4
    assert value(samples, "vllm:inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(samples, "vllm:prompt_tokens_total") == 3


def test_instances_have_separate_registries() -> None:
    one = EngineMetrics("one", block_size=16, num_blocks=64)
    two = EngineMetrics("two", block_size=32, num_blocks=8)  # a shared registry would reject these names
    one.record_step(stats(10, 5, 0, running=3), num_batched_tokens=4)
    assert value(scrape(one), "vllm:num_requests_running") == 3
    assert value(scrape(two), "vllm:num_requests_running") == 0
    assert value(scrape(two), "vllm:prefix_cache_hits_total") == 0
    assert value(scrape(two), "vllm:cache_config_info", block_size="32", num_gpu_blocks="8") == 1


def test_token_buckets_follow_1_2_5_up_to_the_model_length() -> None:
    assert build_1_2_5_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert build_1_2_5_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_a_parallel_request_counts_once_by_its_first_completions_reason() -> None:
    metrics = EngineMetrics("m", block_size=16, num_blocks=64)
    early = synthetic([5, 6], 1.0, 1.5, False)
    early.outputs = [CompletionOutput(0, "", [5, 6], finish_reason="stop"), CompletionOutput(1, "", [7, 8])]
    # a DELTA output only carries the completions that moved: completion 0 ended in the previous one
    last = synthetic([9], 1.0, 2.0, True)
    last.outputs = [CompletionOutput(1, "", [9], finish_reason="length")]
    metrics.record_output(early, 9.0, DELTA)
    metrics.record_output(last, 9.0, DELTA)
    samples = scrape(metrics)
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 0
    assert value(samples, "vllm:generation_tokens_total") == 5
    assert value(samples, "vllm:request_generation_tokens_sum") == 5
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 3  # 5 tokens, 2 of them firsts
