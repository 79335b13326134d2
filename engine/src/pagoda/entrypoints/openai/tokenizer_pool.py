"""Tokenizing and chat-template rendering for the server, off the event loop and off the engine thread.

A megabyte prompt takes seconds to tokenize. On the event loop that stalls every stream and ``/health``;
on the engine thread it stalls every running sequence. So the server hands that work to a pool:

- ``process`` (the default): worker processes, each with its own copy of the tokenizer. Nothing they do
  takes the server's GIL, and a tokenizer that crashes on hostile input takes down a worker, not the
  server (the pool is then rebuilt). Costs ~2 s more start-up (overlapped with model loading) and ~300 MB
  per worker (transformers imports torch).
- ``thread``: threads of the server process, a tokenizer each. The Rust tokenizer releases the GIL while it
  encodes, but Jinja rendering and the Python around it do not.

Measured with ``benchmarks/serve_isolation.py`` (Qwen3-0.6B shape, 2 vCPUs, 8 streams): equal serving
throughput at concurrency 32; with 1 MB prompts tokenized, about equal (both share the same two cores with
the engine); with 1000-message chats rendered back to back, the streams kept 42 tok/s with processes and
30 with threads, and their largest gap was 0.5-0.9 s against 1.0-1.1 s. See benchmarks/README.md.
Errors: ValueError means the input was refused (a 400 for the caller); anything else is this pool's
failure, reported as :class:`TokenizerPoolError` with the details in the log.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.entrypoints.openai.defaults import DEFAULT_POOL_SIZE, DEFAULT_POOL_TYPE, POOL_TYPES
from pagoda.tokenizer import ChatRenderOptions, encode_prompt, get_tokenizer, render_chat_template

logger = logging.getLogger(__name__)


class TokenizerPoolError(RuntimeError):
    """The pool could not do the work (not the input's fault); the message is safe to show a client."""


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """Everything a worker needs to build its tokenizer (picklable)."""

    path: str
    chat_template: Optional[str] = None


# ---- worker side: one tokenizer per process (process pool) or per thread (thread pool) ----------

_local = threading.local()


def _init_worker(spec: TokenizerSpec) -> None:
    _local.spec = spec
    _local.tokenizer = get_tokenizer(spec.path)
    parent = multiprocessing.parent_process()
    if parent is not None:  # a worker process: never outlive the server, however it ends (SIGKILL included)
        threading.Thread(target=_exit_with, args=(parent,), name="pagoda-parent-watch", daemon=True).start()


def _exit_with(parent) -> None:
    parent.join()  # returns when the parent process is gone
    os._exit(0)


def _tokenizer() -> Any:
    return _local.tokenizer


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    return encode_prompt(_tokenizer(), text, add_special_tokens)


def _render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool, options: ChatRenderOptions) -> list[int]:
    tokenizer = _tokenizer()
    template = _local.spec.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model has no chat template; start the server with --chat-template to use chat completions"
        )
    text = render_chat_template(tokenizer, messages, template, add_generation_prompt, options)
    return encode_prompt(tokenizer, text, add_special_tokens=False)


def _decode(token_ids: list[int]) -> str:
    return _tokenizer().decode(token_ids)


def _ping() -> bool:
    return _tokenizer() is not None


# ---- server side --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Starting:
    futures: list[Future]

    def wait(self) -> None:
        for future in self.futures:
            future.result()


class TokenizerPool:
    """Async tokenizing on a process or thread pool; see the module docstring."""

    def __init__(self, spec: TokenizerSpec, pool_type: str = DEFAULT_POOL_TYPE, size: int = DEFAULT_POOL_SIZE) -> None:
        if pool_type not in POOL_TYPES:
            raise ValueError(f"tokenizer pool type must be one of {', '.join(POOL_TYPES)}, got {pool_type!r}")
        if size < 1:
            raise ValueError(f"tokenizer pool size must be at least 1, got {size}")
        self.spec = spec
        self.pool_type = pool_type
        self.size = size
        self._lock = threading.Lock()
        self._executor: Optional[Executor] = None

    def start(self) -> _Starting:
        """Start the workers; ``.wait()`` on the result returns once each has loaded its tokenizer (and
        raises what a worker raised). Call off the event loop."""
        executor = self._get_executor()
        return _Starting([executor.submit(_ping) for _ in range(self.size)])

    def shutdown(self) -> None:
        """Stop the workers (queued calls are cancelled; running ones, bounded by the prompt limits, finish)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; ValueError if the tokenizer refuses it."""
        return await self._run(_encode, text, add_special_tokens)

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        options: Optional[ChatRenderOptions] = None,
    ) -> list[int]:
        """Token ids of the chat template applied to ``messages``; ValueError for messages it refuses."""
        return await self._run(_render_chat, messages, add_generation_prompt, options or ChatRenderOptions())

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(_decode, token_ids)

    async def _run(self, fn, *args) -> Any:
        executor = self._get_executor()
        try:
            return await asyncio.wrap_future(executor.submit(fn, *args))
        except ValueError:
            raise
        except BrokenProcessPool:
            logger.error("a tokenizer worker process died; starting new ones")
            self._discard(executor)
            raise TokenizerPoolError("the tokenizer worker failed on this request") from None
        except Exception:
            logger.exception("tokenizer pool call %s failed", fn.__name__)
            raise TokenizerPoolError("the request could not be tokenized") from None

    def _get_executor(self) -> Executor:
        with self._lock:
            if self._executor is None:
                self._executor = self._new_executor()
            return self._executor

    def _new_executor(self) -> Executor:
        if self.pool_type == "thread":
            return ThreadPoolExecutor(
                self.size, thread_name_prefix="pagoda-tokenizer", initializer=_init_worker, initargs=(self.spec,)
            )
        # spawn, not fork: the server process already runs threads (engine, loader) and torch's pools.
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(self.size, mp_context=context, initializer=_init_worker, initargs=(self.spec,))

    def _discard(self, executor: Executor) -> None:
        with self._lock:
            if self._executor is executor:
                self._executor = None
        executor.shutdown(wait=False, cancel_futures=True)
