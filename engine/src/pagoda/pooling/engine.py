"""The pooling engine: one worker thread that batches every queued input into padded forwards.

Requests hand their inputs (token-id lists) to :meth:`AsyncPoolingEngine.submit` and await the results. The worker
takes everything queued at once, sorts it by length (so a batch pads little), cuts it into forwards of at most
``max_batch_tokens`` padded tokens, and runs them on the engine's device, dtype and torch threads. No KV cache, no
scheduler, no sampling: a forward's inputs finish together. A forward that fails fails the requests in it (the
error is logged) and the engine goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from pagoda.config import EngineArgs
from pagoda.engine.engine_config import resolve_device
from pagoda.model_config import ModelConfig, resolve_dtype
from pagoda.pooling.kernels import prepare_pooling_kernels
from pagoda.pooling.model import PoolingModel, architecture_of, load_pooling_model
from pagoda.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_TOKENS = 16384  # padded tokens per forward (128-token inputs: 128 of them)
KINDS = ("embed", "score")


class PoolingEngineDead(RuntimeError):
    """The engine was shut down; nothing more is accepted."""


@dataclass(slots=True)
class PoolInput:
    """One sequence to pool: token ids (and BERT's token types for a pair)."""

    token_ids: list[int]
    token_types: Optional[list[int]] = None


@dataclass(slots=True)
class _Job:
    kind: str
    inputs: list[PoolInput]
    future: Future
    results: list = field(default_factory=list)


class PoolingEngine:
    """The model, its tokenizer and its limits (the synchronous half; :class:`AsyncPoolingEngine` runs it)."""

    lora = None  # adapters are for generation models

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        model_dir = args.resolved_model_path()
        self.args = args
        self.device = resolve_device(args.device)
        self.tokenizer = get_tokenizer(args.tokenizer or str(model_dir))
        architecture = architecture_of(model_dir)
        # BERT's config.json has every field ModelConfig requires; its dtype and context length are read the same way
        self.model_config = ModelConfig.from_model_dir(model_dir)
        self.dtype = resolve_dtype(args.dtype, self.model_config, self.device)
        task = resolve_task(args, architecture)
        self.model: PoolingModel = load_pooling_model(model_dir, task, self.dtype, self.device, self.tokenizer)
        self.linear_kernels = prepare_pooling_kernels(self.model.network, self.device, self.dtype)
        limit = self.model.spec.max_tokens
        self.max_model_len = limit if args.max_model_len is None else min(limit, args.max_model_len)
        self.max_batch_tokens = max(args.max_num_batched_tokens or DEFAULT_MAX_BATCH_TOKENS, self.max_model_len)
        self.vocab_size = self.model_config.vocab_size
        logger.info("pooling model %s: %s", architecture, self.model.spec)

    @property
    def task(self) -> str:
        return self.model.spec.task

    def check_input(self, token_ids: list[int]) -> None:
        """ValueError for an empty input, one longer than the model takes, or an id outside the vocabulary."""
        if not token_ids:
            raise ValueError("an input has no tokens")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"an input has {len(token_ids)} tokens; this model takes at most {self.max_model_len} (max_model_len)"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")

    def run(self, kind: str, inputs: list[PoolInput]) -> list:
        """One padded forward: embeddings ([hidden] float32 tensors) or scores (floats)."""
        ids = [item.token_ids for item in inputs]
        if kind == "embed":
            return list(self.model.embed(ids).unbind(0))
        types = [item.token_types or [] for item in inputs]
        return self.model.score(ids, types if any(types) else None).tolist()


def resolve_task(args: EngineArgs, architecture: str) -> str:
    """embed or score: ``--task`` (``--runner pooling --convert auto``: the architecture decides)."""
    if args.runner == "pooling" and args.convert == "auto" and architecture.endswith("ForSequenceClassification"):
        return "score"
    if args.task not in KINDS:
        raise ValueError(f"the pooling engine serves --task embed or score, not {args.task}")
    return args.task


class AsyncPoolingEngine:
    """:class:`PoolingEngine` on one worker thread, fed by a queue; awaitable results."""

    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self._queue: queue.SimpleQueue[Optional[_Job]] = queue.SimpleQueue()
        self._waiting = 0  # inputs queued or in the forward running now
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="pagoda-pooling", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def num_waiting_seqs(self) -> int:
        return self._waiting

    async def run(self, kind: str, inputs: list[PoolInput]) -> list:
        """The results of ``inputs`` in order (embeddings or scores); PoolingEngineDead after shutdown."""
        return await asyncio.wrap_future(self.submit(kind, inputs))

    def submit(self, kind: str, inputs: list[PoolInput]) -> Future:
        assert kind in KINDS, kind
        if self._stopped:
            raise PoolingEngineDead("the pooling engine is not running")
        job = _Job(kind, inputs, Future())
        with self._lock:
            self._waiting += len(inputs)
        self._queue.put(job)
        return job.future

    def shutdown(self, timeout: float = 5) -> None:
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get())
            live = [job for job in jobs if job is not None]
            for job in live:
                job.results = [None] * len(job.inputs)
            for kind in KINDS:
                self._run_kind(kind, [job for job in live if job.kind == kind])
            if len(live) < len(jobs) or self._stopped:
                self._fail_queued()
                return

    def _run_kind(self, kind: str, jobs: list[_Job]) -> None:
        items = sorted(
            ((job, i) for job in jobs for i in range(len(job.inputs))),
            key=lambda item: len(item[0].inputs[item[1]].token_ids),
        )
        failed: set[int] = set()
        for batch in _batches(items, self.engine.max_batch_tokens):
            try:
                outputs = self.engine.run(kind, [job.inputs[i] for job, i in batch])
            except Exception as exc:  # one forward's failure fails its requests, not the engine
                logger.exception("a pooling forward of %d inputs failed", len(batch))
                for job, _ in batch:
                    if id(job) not in failed and not job.future.done():
                        failed.add(id(job))
                        job.future.set_exception(RuntimeError(f"the forward failed: {type(exc).__name__}"))
                outputs = [None] * len(batch)
            for (job, i), output in zip(batch, outputs):
                job.results[i] = output
            with self._lock:
                self._waiting -= len(batch)
        for job in jobs:
            if not job.future.done():
                job.future.set_result(job.results)

    def _fail_queued(self) -> None:
        while not self._queue.empty():
            job = self._queue.get()
            if job is not None and not job.future.done():
                job.future.set_exception(PoolingEngineDead("the pooling engine stopped"))


def _batches(items: list, max_tokens: int) -> list[list]:
    """Length-sorted items cut so that rows x longest row <= max_tokens (one item at least per batch)."""
    batches: list[list] = []
    current: list = []
    for item in items:
        length = len(item[0].inputs[item[1]].token_ids)
        if current and (len(current) + 1) * length > max_tokens:
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches
