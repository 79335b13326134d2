"""Request and response models of the pooling endpoints: ``/v1/embeddings`` (OpenAI's), ``/v1/score`` (vLLM's) and
``/v1/rerank`` / ``/rerank`` (Jina's and Cohere's shape, as vLLM serves it).

Types are strict, unknown fields ignored, as in :mod:`protocol`; an invalid value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagoda.entrypoints.openai.protocol import Int, TokenId

_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)

NonEmptyText = Annotated[list[str], Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
EmbeddingInput = Union[str, NonEmptyText, TokenIds, Annotated[list[TokenIds], Field(min_length=1)]]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: a string, strings, token ids or lists of token ids."""

    model_config = _REQUEST_CONFIG

    model: Optional[str] = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Int] = Field(default=None, ge=1)
    user: Optional[str] = None
    add_special_tokens: bool = True  # vLLM's extension

    def inputs(self) -> list[Union[str, list[int]]]:
        """One entry per embedding asked for: a text or a token-id list."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


class ScoreRequest(BaseModel):
    """``POST /v1/score`` (vLLM): ``text_1`` against each of ``text_2`` (one to many, or pairwise when both are lists
    of the same length)."""

    model_config = _REQUEST_CONFIG

    model: Optional[str] = None
    text_1: Union[str, NonEmptyText]
    text_2: Union[str, NonEmptyText]

    def pairs(self) -> list[tuple[str, str]]:
        """The (text_1, text_2) pairs to score, in order; ValueError when the lists cannot be paired."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if len(first) == 1:
            return [(first[0], text) for text in second]
        if len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} entries and text_2 {len(second)}: give one text_1, or as many")
        return list(zip(first, second))


class RerankDocument(BaseModel):
    """A document given as an object (Cohere's ``{"text": ...}``)."""

    model_config = _REQUEST_CONFIG

    text: str


class RerankRequest(BaseModel):
    """``POST /v1/rerank`` (Jina / Cohere): the documents ordered by relevance to the query."""

    model_config = _REQUEST_CONFIG

    model: Optional[str] = None
    query: str
    documents: Annotated[list[Union[str, RerankDocument]], Field(min_length=1)]
    top_n: Optional[Int] = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # base64: little-endian float32


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: PoolingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Optional[dict[str, Any]] = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage
