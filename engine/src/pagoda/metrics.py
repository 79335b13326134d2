"""Prometheus metrics for ``GET /metrics``, named as vLLM names them (``vllm:*``).

Two writers feed one :class:`EngineMetrics`: the engine thread calls :meth:`EngineMetrics.record_step`
after every step (gauges, and counters that mirror the engine's cumulative counters), and the
server calls :meth:`EngineMetrics.record_output` for every output it delivers to a client (token
counts and per-request latencies) and :meth:`EngineMetrics.record_abort` for a request that ends
without a finished output. Each instance owns its own registry, so several servers (or tests) in
one process never share series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from pagoda.engine.llm_engine import EngineStats
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import RequestOutputKind

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read the same.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
INTER_TOKEN_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort", "error")
# The ``priority`` label of the by-priority gauges: -1, 0 and 1 (high, default, low) as themselves, every other value
# in "<-1" or ">1", so the label has five values whatever priorities clients send (vLLM's proposal, #58077).
PRIORITY_LABELS = ("<-1", "-1", "0", "1", ">1")
DEFAULT_MAX_TOKENS_BUCKET = 65536


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass(slots=True)
class _RequestTrack:
    """What the metrics remember about a request between its outputs."""

    tokens_seen: dict[int, int] = field(default_factory=dict)  # completion index -> tokens counted
    last_token_time: dict[int, float] = field(default_factory=dict)  # completion index -> time of its last token
    finish_reasons: dict[int, str] = field(default_factory=dict)  # completion index -> finish reason


class _WithoutCreated:
    """Collector exposing the wrapped metrics minus their ``*_created`` samples.

    vLLM turns those off with the process-global ``disable_created_metrics()``; filtering here keeps
    the exposition identical without changing other registries in the process.
    """

    def __init__(self, metrics: list) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        for metric in self._metrics:
            yield from metric.describe()

    def collect(self) -> Iterable[Metric]:
        for metric in self._metrics:
            for family in metric.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family


def priority_label(priority: int) -> str:
    """The bucket of ``PRIORITY_LABELS`` a request priority is counted in."""
    if priority < -1:
        return "<-1"
    if priority > 1:
        return ">1"
    return str(priority)


def _by_priority_label(counts: Iterable[tuple[int, int]]) -> dict[str, int]:
    labels = dict.fromkeys(PRIORITY_LABELS, 0)
    for priority, count in counts:
        labels[priority_label(priority)] += count
    return labels


def _gauge(name: str, documentation: str, *extra_labels: str) -> Gauge:
    return Gauge(name, documentation, ["model_name", *extra_labels], registry=None)


def _counter(name: str, documentation: str, *extra_labels: str) -> Counter:
    return Counter(name, documentation, ["model_name", *extra_labels], registry=None)


def _histogram(name: str, documentation: str, buckets: list) -> Histogram:
    return Histogram(name, documentation, ["model_name"], buckets=buckets, registry=None)


def _latency(name: str, what: str) -> Histogram:
    return _histogram(name, f"Histogram of {what} in seconds.", REQUEST_LATENCY_BUCKETS)


class EngineMetrics:
    """vLLM-named Prometheus metrics of one served model; thread-safe.

    Every series carries the ``model_name`` label. Token and latency metrics describe what was
    delivered to clients: generated tokens are counted as outputs arrive (aborted requests included),
    prompt tokens and the per-request histograms once a request finishes.
    """

    def __init__(
        self,
        model_name: str,
        block_size: int,
        num_blocks: int,
        registry: Optional[CollectorRegistry] = None,
        max_model_len: Optional[int] = None,
        max_loras: int = 0,  # LoRA slots; 0: LoRA is off and its gauge is not exported
    ) -> None:
        self.model_name = model_name
        self.max_loras = max_loras
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestTrack] = {}
        self._last_engine_counters: dict[str, int] = {}
        token_buckets = build_1_2_5_buckets(max_model_len or DEFAULT_MAX_TOKENS_BUCKET)
        self.num_requests_running = _gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        # Pagoda's own (vLLM exports no priority breakdown): the two gauges above by request priority.
        self.num_requests_running_by_priority = _gauge(
            "pagoda:num_requests_running_by_priority", "Running requests by priority (bucketed).", "priority"
        )
        self.num_requests_waiting_by_priority = _gauge(
            "pagoda:num_requests_waiting_by_priority", "Waiting requests by priority (bucketed).", "priority"
        )
        self.kv_cache_usage_perc = _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = _counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = _counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = _counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = _counter("vllm:prompt_tokens", "Number of prefill tokens of finished requests.")
        self.generation_tokens = _counter("vllm:generation_tokens", "Number of generation tokens delivered.")
        self.request_success = _counter("vllm:request_success", "Count of finished requests.", "finished_reason")
        self.time_to_first_token = _histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = _histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", INTER_TOKEN_BUCKETS
        )
        self.e2e_request_latency = _latency("vllm:e2e_request_latency_seconds", "end to end request latency")
        self.request_queue_time = _latency("vllm:request_queue_time_seconds", "time spent waiting in queue")
        self.request_prefill_time = _latency("vllm:request_prefill_time_seconds", "time spent in prefill")
        self.request_decode_time = _latency("vllm:request_decode_time_seconds", "time spent in decode")
        self.request_inference_time = _latency("vllm:request_inference_time_seconds", "time spent running")
        self.request_prompt_tokens = _histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = _histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        # A histogram despite the "_total" in its name, exactly as in vLLM.
        self.iteration_tokens = _histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self.cache_config_info = _gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig.", "block_size", "num_gpu_blocks"
        )
        self.cache_config_info.labels(model_name, str(block_size), str(num_blocks)).set(1)
        for reason in FINISH_REASONS:  # vLLM exposes every reason from the start, at 0
            self.request_success.labels(model_name, reason)
        by_priority = (self.num_requests_running_by_priority, self.num_requests_waiting_by_priority)
        for gauge in by_priority:
            for label in PRIORITY_LABELS:
                gauge.labels(model_name, label)
        metrics = [m for m in vars(self).values() if isinstance(m, (Counter, Gauge, Histogram))]
        for metric in metrics:
            if metric not in (self.cache_config_info, self.request_success, *by_priority):
                metric.labels(model_name)  # so each series is exposed (at 0) before its first event
        if max_loras:
            # vLLM's: one series whose labels list the adapters running and waiting, set to the time it was last
            # updated. Only the current label set is kept (vLLM keeps every set it has seen).
            self.lora_requests_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=None,
            )
            self._lora_labels: Optional[tuple[str, str, str]] = None
            self._set_lora_info((), ())
            metrics.append(self.lora_requests_info)
        self.registry.register(_WithoutCreated(metrics))

    # ---- engine thread -------------------------------------------------------------------

    def record_step(self, stats: EngineStats, num_batched_tokens: int) -> None:
        """Record one engine step: gauges from ``stats``, counters by how far the engine's cumulative
        counters moved since the previous call, and the step's batched tokens."""
        name = self.model_name
        self.num_requests_running.labels(name).set(stats.num_running)
        self.num_requests_waiting.labels(name).set(stats.num_waiting)
        for gauge, counts in (
            (self.num_requests_running_by_priority, stats.running_by_priority),
            (self.num_requests_waiting_by_priority, stats.waiting_by_priority),
        ):
            for label, count in _by_priority_label(counts).items():
                gauge.labels(name, label).set(count)
        self.kv_cache_usage_perc.labels(name).set(stats.kv_cache_usage)
        for key, counter, value in (
            ("prefix_cache_queries", self.prefix_cache_queries, stats.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits, stats.prefix_cache_hits),
            ("num_preemptions", self.num_preemptions, stats.num_preemptions),
        ):
            delta = self._advance(key, value)
            if delta > 0:
                counter.labels(name).inc(delta)
        if num_batched_tokens > 0:
            self.iteration_tokens.labels(name).observe(num_batched_tokens)
        if self.max_loras:
            self._set_lora_info(stats.running_lora_adapters, stats.waiting_lora_adapters)

    def _set_lora_info(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        labels = (str(self.max_loras), ",".join(waiting), ",".join(running))
        with self._lock:
            if labels != self._lora_labels and self._lora_labels is not None:
                self.lora_requests_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora_requests_info.labels(*labels).set_to_current_time()

    def _advance(self, key: str, value: int) -> int:
        with self._lock:
            last = self._last_engine_counters.get(key, 0)
            self._last_engine_counters[key] = value
        # a smaller value means a fresh engine counting from zero again: never move backwards
        return value - last if value >= last else 0

    # ---- server side ---------------------------------------------------------------------

    def record_output(self, output: RequestOutput, now: float, output_kind: RequestOutputKind) -> None:
        """Record one output as delivered to a client.

        ``output_kind`` is the request's ``SamplingParams.output_kind``: with DELTA the completions'
        ``token_ids`` are the new tokens; with CUMULATIVE and FINAL_ONLY they are everything so far,
        and the new tokens are those beyond what this request's earlier outputs carried. Each new
        token counts toward ``vllm:generation_tokens_total``; the time since a completion's previous
        token (engine timestamps: ``metrics.last_token_time``, else ``now``) is divided evenly over the
        tokens that arrived together, the first token of a completion having no inter-token latency.
        When the output is finished, the per-request metrics are recorded and its tracking dropped:
        ``request_success_total`` counts the request once, by completion 0's finish reason.
        """
        with self._lock:
            track = self._requests.setdefault(output.request_id, _RequestTrack())
            new_tokens, gaps = self._new_tokens(track, output, now, output_kind)
            if output.finished:
                del self._requests[output.request_id]
        name = self.model_name
        if new_tokens:
            self.generation_tokens.labels(name).inc(new_tokens)
        itl = self.inter_token_latency.labels(name)
        for gap, count in gaps:
            for _ in range(count):
                itl.observe(gap)
        if output.finished:
            self._record_finished(output, track, now)

    def record_abort(self, request_id: str) -> None:
        """Record a request that ended without a finished output (aborted, e.g. its client left).

        Call it at most once per request, and never for one whose finished output was recorded. It
        counts ``request_success_total{finished_reason="abort"}``; the latency and prompt-token metrics
        stay those of completed requests.
        """
        with self._lock:
            self._requests.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    @staticmethod
    def _new_tokens(
        track: _RequestTrack, output: RequestOutput, now: float, output_kind: RequestOutputKind
    ) -> tuple[int, list[tuple[float, int]]]:
        """(tokens new in this output, [(inter-token gap, number of tokens it applies to)])."""
        delta = output_kind == RequestOutputKind.DELTA
        token_time = output.metrics.last_token_time if output.metrics.last_token_time is not None else now
        total = 0
        gaps: list[tuple[float, int]] = []
        for completion in output.outputs:
            index = completion.index
            if completion.finish_reason is not None:
                track.finish_reasons[index] = completion.finish_reason
            seen = track.tokens_seen.get(index, 0)
            new = len(completion.token_ids) if delta else max(len(completion.token_ids) - seen, 0)
            if new == 0:
                continue
            track.tokens_seen[index] = seen + new
            total += new
            previous = track.last_token_time.get(index)
            if previous is None:  # the completion's first token: the gap is measured from it
                new -= 1
                previous = output.metrics.first_token_time if output.metrics.first_token_time is not None else now
            if new > 0:
                gaps.append((max(token_time - previous, 0.0) / new, new))
            track.last_token_time[index] = token_time
        return total, gaps

    def _record_finished(self, output: RequestOutput, track: _RequestTrack, now: float) -> None:
        name = self.model_name
        times = output.metrics
        finished_time = times.finished_time if times.finished_time is not None else now
        num_prompt = len(output.prompt_token_ids)
        self.prompt_tokens.labels(name).inc(num_prompt)
        self.request_prompt_tokens.labels(name).observe(num_prompt)
        self.request_generation_tokens.labels(name).observe(sum(track.tokens_seen.values()))
        self.e2e_request_latency.labels(name).observe(max(finished_time - times.arrival_time, 0.0))
        if times.first_token_time is not None:
            self.time_to_first_token.labels(name).observe(max(times.first_token_time - times.arrival_time, 0.0))
        if times.first_scheduled_time is not None:
            self.request_queue_time.labels(name).observe(max(times.first_scheduled_time - times.arrival_time, 0.0))
            self.request_inference_time.labels(name).observe(max(finished_time - times.first_scheduled_time, 0.0))
            if times.first_token_time is not None:
                prefill = times.first_token_time - times.first_scheduled_time
                self.request_prefill_time.labels(name).observe(max(prefill, 0.0))
        if times.first_token_time is not None and times.last_token_time is not None:
            self.request_decode_time.labels(name).observe(max(times.last_token_time - times.first_token_time, 0.0))
        reasons = track.finish_reasons
        # a finished output always carries its reasons; "stop" only guards against a malformed one
        reason = reasons.get(0) or next(iter(reasons.values()), None) or "stop"
        self.request_success.labels(name, reason).inc()

    # ---- exposition ----------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this instance's registry, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
