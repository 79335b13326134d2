"""The pooling endpoints: ``/v1/embeddings``, ``/v1/score``, ``/v1/rerank`` and ``/rerank`` (see :mod:`pagoda.pooling`).

A server started with ``--task embed`` or ``--task score`` builds :class:`PoolingServing` over an
:class:`~pagoda.pooling.engine.AsyncPoolingEngine` instead of the generation engine (no KV cache). Every request
goes through the generation endpoints' stages: the list and character limits, an admission reservation of its inputs
against ``--max-num-queued-requests`` (429 when full), tokenizing off the event loop (texts on the tokenizer pool; a
cross-encoder's pairs on a thread, since they need the tokenizer's pair encoding), then the engine's worker thread.
On a generation server these routes answer 400, and on a pooling server completions and chat do.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request

from pagoda.entrypoints.openai.errors import OpenAIError, bad_request, internal_error, service_unavailable
from pagoda.entrypoints.openai.limits import AdmissionControl, RequestChecker
from pagoda.entrypoints.openai.openapi import route_responses
from pagoda.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagoda.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from pagoda.entrypoints.openai.serving import detokenize_ids
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool, TokenizerPoolError
from pagoda.pooling.engine import AsyncPoolingEngine, PoolingEngine, PoolingEngineDead, PoolInput
from pagoda.pooling.model import RERANK_PREFIX, RERANK_SUFFIX, rerank_prompt

GENERATION_SERVER = (
    "this server runs a generation model; start it with --task embed for /v1/embeddings, or --task score for "
    "/v1/score and /v1/rerank"
)


class PoolingServing:
    """Validated pooling requests -> engine inputs -> OpenAI / vLLM / Jina responses."""

    def __init__(
        self,
        engine: AsyncPoolingEngine,
        model_name: str,
        pool: TokenizerPool,
        checker: RequestChecker,
        admission: AdmissionControl,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.pool = pool
        self.checker = checker
        self.admission = admission
        sync = engine.engine
        self.spec = sync.model.spec
        self._pair_lock = threading.Lock()  # the tokenizer's pair encoding changes its settings while it runs
        if self.spec.scorer == "yes_no":
            self._prefix = sync.tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
            self._suffix = sync.tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)

    # ---- endpoints ------------------------------------------------------------------------------

    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        if self.spec.task != "embed":
            raise bad_request("this server scores pairs (--task score): use /v1/score or /v1/rerank", "input")
        if body.dimensions is not None and body.dimensions > self.spec.hidden_size:
            raise bad_request(f"dimensions must be at most {self.spec.hidden_size}", "dimensions")
        inputs = body.inputs()
        self.checker.check_prompts(inputs)
        with self.admission.reserve(len(inputs)):
            ids = await self._encode(inputs, body.add_special_tokens, "input")
            future = self._submit("embed", [PoolInput(i) for i in ids], "input")
        vectors = await self._results(future)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode_vector(self._shape(v, body.dimensions), body)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(map(len, ids))
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": self.model_name, "usage": usage}

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        try:
            pairs = body.pairs()
        except ValueError as exc:
            raise bad_request(str(exc), "text_2") from None
        scores, tokens = await self._score_pairs(pairs, "text_2")
        data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        texts = body.texts()
        scores, tokens = await self._score_pairs([(body.query, text) for text in texts], "documents")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = [
            {
                "index": i,
                "relevance_score": scores[i],
                "document": {"text": texts[i]} if body.return_documents else None,
            }
            for i in order
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name, "results": results, "usage": usage}

    async def completions(self, body: Any, raw: Request) -> Any:
        raise bad_request(self._not_generation(), "model")

    async def chat(self, body: Any, raw: Request) -> Any:
        raise bad_request(self._not_generation(), "model")

    def _not_generation(self) -> str:
        return (
            f"this server runs a pooling model (--task {self.spec.task}): it serves /v1/embeddings"
            + (" " if self.spec.task == "embed" else ", /v1/score and /v1/rerank ")
            + "but no completions or chat; start a generation model with --task generate"
        )

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if body.prompt is None:
            raise bad_request("a pooling server tokenizes prompts, not messages", "messages")
        self.checker.check_prompts([body.prompt])
        tokens = (await self._encode([body.prompt], body.add_special_tokens, "prompt"))[0]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.engine.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        return await detokenize_ids(self.pool, body.tokens, self.engine.engine.vocab_size)

    # ---- stages ---------------------------------------------------------------------------------

    async def _score_pairs(self, pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int]:
        """Scores of (query, document) pairs and the tokens they took."""
        if self.spec.task != "score":
            raise bad_request("this server embeds (--task embed): use /v1/embeddings, or start it with --task score")
        self.checker.check_prompts([doc for _, doc in pairs])
        self.checker.check_prompts(sorted({query for query, _ in pairs}))
        with self.admission.reserve(len(pairs) * (2 if self.spec.scorer == "cosine" else 1)):
            if self.spec.scorer == "cosine":  # an embedding model scores a pair by the cosine of its embeddings
                texts = [text for pair in pairs for text in pair]
                ids = await self._encode(texts, True, param)
                future = self._submit("embed", [PoolInput(i) for i in ids], param)
            else:
                inputs = await self._pair_inputs(pairs, param)
                future = self._submit("score", inputs, param)
        results = await self._results(future)
        if self.spec.scorer == "cosine":
            scores = [float(F.cosine_similarity(a, b, dim=0)) for a, b in zip(results[0::2], results[1::2])]
            return scores, sum(map(len, ids))
        return [float(s) for s in results], sum(len(item.token_ids) for item in inputs)

    async def _pair_inputs(self, pairs: list[tuple[str, str]], param: str) -> list[PoolInput]:
        if self.spec.scorer == "yes_no":  # Qwen3-Reranker: prefix + instruction/query/document + suffix
            middles = await self._encode([rerank_prompt(q, d) for q, d in pairs], False, param)
            return [PoolInput(self._prefix + ids + self._suffix) for ids in middles]
        try:
            encoded = await asyncio.to_thread(self._encode_pairs, pairs)
        except ValueError as exc:
            raise bad_request(str(exc), param) from None
        for item in encoded:
            self._check(item.token_ids, param)
        return encoded

    def _encode_pairs(self, pairs: list[tuple[str, str]]) -> list[PoolInput]:
        tokenizer = self.engine.engine.tokenizer
        with self._pair_lock:
            encoded = tokenizer([q for q, _ in pairs], [d for _, d in pairs])
        types = encoded.get("token_type_ids")
        return [PoolInput(list(ids), list(types[i]) if types else None) for i, ids in enumerate(encoded["input_ids"])]

    async def _encode(self, inputs: list[Union[str, list[int]]], add_special: bool, param: str) -> list[list[int]]:
        """Token ids of every input (texts through the pool, all at once), each checked against the model."""
        texts = [text for text in inputs if isinstance(text, str)]
        results = await asyncio.gather(*(self.pool.encode(t, add_special) for t in texts), return_exceptions=True)
        for result in results:
            if isinstance(result, ValueError):
                raise bad_request(str(result), param)
            if isinstance(result, TokenizerPoolError):
                raise internal_error(str(result))
            if isinstance(result, BaseException):
                raise result
        encoded = iter(results)
        ids = [next(encoded) if isinstance(item, str) else item for item in inputs]
        for item in ids:
            self._check(item, param)  # type: ignore[arg-type]
        return ids  # type: ignore[return-value]

    def _check(self, token_ids: list[int], param: str) -> None:
        try:
            self.engine.engine.check_input(token_ids)
        except ValueError as exc:
            raise bad_request(str(exc), param) from None

    def _submit(self, kind: str, inputs: list[PoolInput], param: str):
        try:
            return self.engine.submit(kind, inputs)
        except PoolingEngineDead:
            raise service_unavailable("the pooling engine is not running; the request was not accepted") from None

    async def _results(self, future) -> list:
        try:
            return await asyncio.wrap_future(future)
        except PoolingEngineDead:
            raise service_unavailable("the pooling engine stopped; the request was aborted") from None
        except RuntimeError as exc:
            raise internal_error(str(exc)) from None

    def _shape(self, vector: torch.Tensor, dimensions: Optional[int]) -> torch.Tensor:
        """Matryoshka truncation to ``dimensions``, renormalised when the model normalises."""
        if dimensions is None or dimensions >= vector.shape[0]:
            return vector
        vector = vector[:dimensions]
        return F.normalize(vector, dim=0) if self.spec.normalize else vector


def _encode_vector(vector: torch.Tensor, body: EmbeddingRequest) -> Union[list[float], str]:
    if body.encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def load_pooling(args, config, model_name: str, pool: TokenizerPool, starting) -> tuple[AsyncPoolingEngine, Any]:
    """The pooling engine and its serving for ``pagoda serve --task embed|score`` (the server's loader thread)."""
    engine = PoolingEngine(args)
    starting.wait()
    async_engine = AsyncPoolingEngine(engine)
    limits = config.limits
    serving = PoolingServing(
        async_engine,
        model_name,
        pool,
        RequestChecker(limits, limits.prompt_chars(engine.max_model_len)),
        AdmissionControl(config.max_num_queued_requests, lambda: async_engine.num_waiting_seqs),
    )
    return async_engine, serving


def add_pooling_routes(app: FastAPI, check_admission: Callable[[Optional[str]], Any]) -> None:
    """``/v1/embeddings``, ``/v1/score``, ``/v1/rerank`` and ``/rerank``; ``check_admission(model)`` is the server's
    (503 while loading or draining, 404 for another model) and returns its serving."""
    errors = {code: body for code, body in route_responses("/v1/completions").items() if code != 200}

    def serving_of(model: Optional[str]) -> PoolingServing:
        serving = check_admission(model)
        if not isinstance(serving, PoolingServing):
            raise OpenAIError(400, GENERATION_SERVER, param="model", code="wrong_task")
        return serving

    def route(path: str, model: type):
        return app.post(path, response_model=None, responses={200: {"model": model}, **errors})

    @route("/v1/embeddings", EmbeddingResponse)
    async def embeddings(body: EmbeddingRequest) -> dict:
        return await serving_of(body.model).embeddings(body)

    @route("/v1/score", ScoreResponse)
    async def score(body: ScoreRequest) -> dict:
        return await serving_of(body.model).score(body)

    async def rerank(body: RerankRequest) -> dict:
        return await serving_of(body.model).rerank(body)

    for path in ("/v1/rerank", "/rerank"):  # vLLM's path and Jina's
        route(path, RerankResponse)(rerank)
