"""The step-level engine: admit requests, run one scheduled step at a time, emit outputs."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Optional, Union

import torch

from pagoda.config import EngineArgs
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_events import KVEventCollector
from pagoda.core.scheduler import Scheduler
from pagoda.engine.engine_config import resolve_engine_config
from pagoda.engine.kv_event_publisher import start_kv_events
from pagoda.engine.lora_requests import LoRAEngineMixin
from pagoda.engine.output_processor import OutputProcessor
from pagoda.executor import Executor, create_executor
from pagoda.outputs import RequestOutput
from pagoda.request import Request, RequestStatus, sequence_id
from pagoda.sampling_params import SamplingParams, validate_for_vocab
from pagoda.structured_output.compiler import StructuredOutputCompiler
from pagoda.structured_output.grammar import RequestGrammar
from pagoda.structured_output.params import StructuredOutputsParams
from pagoda.tokenizer import encode_prompt, get_tokenizer

logger = logging.getLogger(__name__)

# How long a step with nothing to run but compiling grammars waits for one of them before returning.
_GRAMMAR_WAIT_S = 0.05


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for metrics and tests)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_chunked_prefill_steps: int
    num_blocks: int
    block_size: int
    running_lora_adapters: tuple[str, ...] = ()  # names of the adapters of running requests
    waiting_lora_adapters: tuple[str, ...] = ()
    # (priority, sequences) of the waiting and the running queue, lowest priority value first
    waiting_by_priority: tuple[tuple[int, int], ...] = ()
    running_by_priority: tuple[tuple[int, int], ...] = ()


class LLMEngine(LoRAEngineMixin):
    """Loads a model, sizes the KV cache, and drives scheduler + model runner step by step."""

    def __init__(self, args: EngineArgs) -> None:
        if args.task != "generate" or args.runner == "pooling":
            raise ValueError(
                f"this engine generates text; --task {args.task} (pooling models) is served by `pagoda serve`, and "
                "offline by pagoda.pooling.engine.PoolingEngine"
            )
        config = resolve_engine_config(args)  # downloads a remote model (or finds it in the cache) first
        self.config = config
        self.args = config.args
        self.model_config = config.model_config
        self.tokenizer = get_tokenizer(config.args.tokenizer or config.model_path)
        self.device = config.device
        self.dtype = config.dtype
        self.max_model_len = config.max_model_len
        torch.manual_seed(config.args.seed)
        self.executor: Executor = create_executor(config.worker, config.parallel, config.cache)
        try:
            self.lora_registry = self._lora_registry(config)
            self.kv_events = start_kv_events(self.args.kv_events_config, self.args.block_size)  # None: off
        except BaseException:
            self.executor.shutdown()
            raise
        scheduler_config = config.scheduler
        num_blocks = self.executor.num_blocks
        self.scheduler = Scheduler(
            scheduler_config,
            KVCacheManager(
                num_blocks, self.args.block_size, self.args.enable_prefix_caching, self._kv_event_collector()
            ),
            adapter_ready=self._adapter_ready if self.lora_registry is not None else None,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._structured_outputs: Optional[StructuredOutputCompiler] = None
        self._structured_outputs_lock = threading.Lock()
        self._structured_outputs_error: Optional[str] = None
        self._compiling: dict[str, Request] = {}  # sequence id -> request whose grammar is compiling
        self._seed_rng = random.Random(self.args.seed)
        self._arrival_seq = itertools.count()
        self.last_step_num_tokens = 0

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Union[None, str, list[int]],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        lora_name: Optional[str] = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request; raises ValueError for anything the engine cannot serve
        (:class:`UnknownLoRAError` for a ``lora_name`` that is not loaded, a non-zero ``priority`` unless the
        scheduling policy is ``priority``, which runs lower values first).

        Everything that can fail runs before the request is registered anywhere, so a refused request
        leaves no state behind.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else _token_ids(prompt)
        self.check_request(prompt_ids, params, priority)
        lora_id = self.lora_id(lora_name)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        generators = self._generators(params)
        request = Request(
            request_id=sequence_id(request_id, 0),
            parent_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            arrival_seq=next(self._arrival_seq),
            eos_token_ids=self.model_config.eos_token_ids,
            max_tokens=max_tokens,
            lora_id=lora_id,
            cache_salt=cache_salt,
            priority=priority,
        )
        if params.structured_outputs is not None:
            request.grammar = RequestGrammar(self.compile_structured_output(params.structured_outputs))
            self._compiling[request.request_id] = request
        request.generator = generators[0]
        request.sibling_generators = generators[1:] if params.n > 1 else None
        self.output_processor.add_request(request, text)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        """Stop requests (all ``n`` sequences of each) and free their blocks; no further output."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_requests(
                self.output_processor.sequence_ids(request_id), RequestStatus.FINISHED_ABORTED
            )
            self.output_processor.remove_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of requests that progressed.

        A request that fails on its own (no valid token, its output cannot be detokenized) gets a
        final output with ``error`` set; the other requests of the step carry on.
        """
        grammar_failures = self._poll_grammars() + self._poll_adapter_reads()
        self._release_unused_adapters()
        plan = self.scheduler.schedule()
        self.last_step_num_tokens = plan.num_batched_tokens
        if plan.is_empty:
            if self._compiling:  # only requests whose grammar is compiling: wait for one, briefly
                wait([r.grammar.future for r in self._compiling.values()], _GRAMMAR_WAIT_S, FIRST_COMPLETED)
                return grammar_failures
            if self.lora_registry is not None and self.lora_registry.awaiting_reads:  # the next poll settles them
                wait([r.future for r in self.lora_registry.pending_reads()], _GRAMMAR_WAIT_S, FIRST_COMPLETED)
                return grammar_failures
            # start-up guarantees one max-length sequence fits, so work can always progress
            assert not self.scheduler.has_unfinished_requests(), "scheduler made no progress"
            return grammar_failures
        adapters, lora_failures = self._fetch_adapters(plan)
        if plan.is_empty:
            return grammar_failures + lora_failures
        result = self.executor.execute_model(plan, adapters)
        failed = {self._external_id(seq_id): message for seq_id, message in result.errors.items()}
        updated = self.scheduler.update_from_output(plan, result)
        for seq_id, message in self.scheduler.pop_request_errors().items():
            failed[self._external_id(seq_id)] = message
        stopped, detokenize_failed = self.output_processor.detokenize(updated)
        failed.update(detokenize_failed)
        self.scheduler.finish_requests([r.request_id for r in stopped], RequestStatus.FINISHED_STOPPED)
        outputs, output_failed = self.output_processor.make_outputs([r for r in updated if r.external_id not in failed])
        failed.update(output_failed)
        for external_id, message in failed.items():
            logger.warning("request_id=%s failed: %s", external_id, message)
            output = self.fail_request(external_id, message)
            if output is not None:
                outputs.append(output)
        if self.kv_events is not None:  # this step's stored and evicted blocks (and those of aborts before it)
            self.kv_events.flush()
        return grammar_failures + lora_failures + outputs

    # ---- structured outputs ----------------------------------------------------------------

    def compile_structured_output(self, spec: StructuredOutputsParams, max_pending: Optional[int] = None) -> Future:
        """The compiled grammar of ``spec`` as a future (cached by spec; any thread may call this). Its
        exception is a ValueError naming what is wrong, which the server answers as a 400. ``max_pending``: see
        ``StructuredOutputCompiler.compile``."""
        return self.structured_output_compiler().compile(spec, max_pending)

    def structured_output_compiler(self) -> StructuredOutputCompiler:
        """Created on first use: importing xgrammar takes seconds that engines without structured outputs
        should not pay (the server warms it up at start). ValueError if this model's tokenizer cannot have one
        (every later call says the same without trying again)."""
        with self._structured_outputs_lock:
            if self._structured_outputs is None and self._structured_outputs_error is None:
                try:
                    self._structured_outputs = StructuredOutputCompiler(
                        self.tokenizer,
                        self.model_config.vocab_size,
                        self.model_config.eos_token_ids,
                        max_whitespace=self.args.structured_output_max_whitespace,
                    )
                except Exception as exc:  # xgrammar cannot read this tokenizer's vocabulary
                    logger.warning("structured outputs are unavailable: %r", exc)
                    self._structured_outputs_error = f"structured outputs are not available for this model ({exc})"
            if self._structured_outputs is None:
                raise ValueError(self._structured_outputs_error)
            return self._structured_outputs

    def _poll_grammars(self) -> list[RequestOutput]:
        """Make matchers for grammars that finished compiling; fail the requests whose grammar did not."""
        outputs: list[RequestOutput] = []
        for seq_id, request in list(self._compiling.items()):
            if request.is_finished:  # aborted while compiling
                del self._compiling[seq_id]
                continue
            if not request.grammar.poll():
                continue
            del self._compiling[seq_id]
            if request.grammar.error is not None:
                logger.info("request_id=%s refused: %s", request.external_id, request.grammar.error)
                output = self.fail_request(request.external_id, request.grammar.error)
                if output is not None:
                    outputs.append(output)
        return outputs

    def fail_request(self, request_id: str, message: str, unavailable: bool = False) -> Optional[RequestOutput]:
        """Finish every sequence of a request with finish reason "error" and free its blocks; returns its
        final output (``error=message``; ``unavailable``: something it needs cannot be had for now, see
        RequestOutput), or None if the request is not running here."""
        self.scheduler.finish_requests(self.output_processor.sequence_ids(request_id), RequestStatus.FINISHED_ERROR)
        return self.output_processor.fail_request(request_id, message, unavailable)

    def _kv_event_collector(self) -> Optional[KVEventCollector]:
        if self.kv_events is None:
            return None
        if self.lora_registry is not None:  # BlockStored names the adapter of the request
            self.kv_events.collector.lora_name_of = self.lora_registry.name_of
        return self.kv_events.collector

    def _external_id(self, seq_id: str) -> str:
        request = self.scheduler.requests.get(seq_id)
        return request.external_id if request is not None else seq_id.rpartition("#")[0]

    def add_death_listener(self, listener) -> None:
        """``listener(error)`` runs once (on another thread) if a tensor-parallel worker process dies: the engine
        can then make no progress. Never called with a single rank."""
        self.executor.add_death_listener(listener)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any, and the KV event publisher (idempotent; the engine
        cannot step afterwards)."""
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()

    def get_stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions_total,
            num_chunked_prefill_steps=self.scheduler.num_chunked_prefill_steps,
            num_blocks=kv.pool.num_blocks,
            block_size=kv.block_size,
            running_lora_adapters=self._adapter_names(self.scheduler.running),
            waiting_lora_adapters=self._adapter_names(self.scheduler.waiting),
            waiting_by_priority=tuple(sorted(self.scheduler.waiting.priority_counts().items())),
            running_by_priority=_by_priority(self.scheduler.running),
        )

    def kv_slot_usage(self) -> tuple[int, int]:
        """(allocated slots, slots holding a live token) over running sequences; a block shared by
        several sequences counts once. ``1 - used / allocated`` is the KV waste."""
        kv = self.scheduler.kv
        allocated: set[int] = set()
        used: dict[int, int] = {}
        for request in self.scheduler.running:
            block_ids = kv.get_block_ids(request)
            allocated.update(block_ids)
            for i, block_id in enumerate(block_ids):
                filled = min(kv.block_size, max(request.num_computed_tokens - i * kv.block_size, 0))
                used[block_id] = max(used.get(block_id, 0), filled)
        return len(allocated) * kv.block_size, sum(used.values())

    # ---- helpers -------------------------------------------------------------------------

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for per position (``--max-logprobs``; -1 is the whole vocabulary)."""
        limit = self.args.max_logprobs
        return self.model_config.vocab_size if limit == -1 else limit

    def check_request(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError if the engine cannot serve this prompt with these params (no side effects).

        The server calls it before a request reaches the engine, so that a streamed request is refused
        with a 400 before its response starts; ``add_request`` calls it again.
        """
        self.check_priority(priority)
        if not prompt_ids:
            raise ValueError("the prompt is empty; it must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        requested = len(prompt_ids) + (params.max_tokens or 1)
        if requested > self.max_model_len or len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{len(prompt_ids)} prompt tokens and asks for {params.max_tokens} more "
                f"({requested} in total). Shorten the prompt or lower max_tokens."
            )
        if params.n > self.scheduler.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.scheduler.config.max_num_seqs}")
        max_logprobs = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name}={value} exceeds the maximum of {max_logprobs} (--max-logprobs)")
        validate_for_vocab(params, vocab)
        if params.min_tokens > 0:
            stop_ids = params.all_stop_token_ids | (
                frozenset() if params.ignore_eos else self.model_config.eos_token_ids
            )
            if sum(1 for t in stop_ids if 0 <= t < vocab) >= vocab:
                raise ValueError(
                    f"min_tokens={params.min_tokens} cannot be met: stop_token_ids (with the EOS tokens unless "
                    "ignore_eos) cover every token of the vocabulary, so no token could be generated"
                )

    def check_priority(self, priority: int) -> None:
        """ValueError unless ``priority`` is an integer, and 0 when the scheduling policy is fcfs (vLLM's rule)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduler.config.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")

    def _generators(self, params: SamplingParams) -> list[Optional[torch.Generator]]:
        """One generator per sequence; a user seed s gives sequence i the seed s + i."""
        if params.greedy:
            return [None] * params.n
        base = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        return [torch.Generator().manual_seed(base + i) for i in range(params.n)]


def _by_priority(requests: list[Request]) -> tuple[tuple[int, int], ...]:
    counts: dict[int, int] = {}
    for request in requests:
        counts[request.priority] = counts.get(request.priority, 0) + 1
    return tuple(sorted(counts.items()))


def _token_ids(prompt: object) -> list[int]:
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("a prompt must be a string or a list of integer token ids")
    return list(prompt)
