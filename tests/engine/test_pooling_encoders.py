"""BERT-style pooling models through a real `pagoda serve --task embed|score` and the official openai client, held to
sentence-transformers itself: a bge-shaped embedder saved as a sentence-transformers folder (mean pooling, Normalize)
and a cross-encoder (``BertForSequenceClassification``, one label) against ``CrossEncoder``.

The checkpoints are random-weight and tiny, built here from transformers configs with a WordPiece tokenizer made by
the ``tokenizers`` library (no downloads).
"""

from __future__ import annotations

import base64
import concurrent.futures
from pathlib import Path

import numpy as np
import openai
import pytest
from pooling_checkpoints import build_bge_folder, build_cross_encoder
from server_helpers import Server, start_server

TEXTS = [
    "the cat sat on the mat",
    "a big red dog ran out",
    "what is the sun",
    "the moon is small and blue",
    "we can run",
    "if it was so",
]
QUERY = "the cat on the mat"


@pytest.fixture(scope="module")
def bge_dir(tmp_path_factory) -> Path:
    """A bge-shaped sentence-transformers folder: BertModel + mean Pooling + Normalize."""
    return build_bge_folder(tmp_path_factory.mktemp("bert-raw"), tmp_path_factory.mktemp("bge-st"))


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def embed_server(bge_dir):
    server = start_server(
        str(bge_dir), "--task", "embed", "--served-model-name", "bge", "--tokenizer-pool-type", "thread",
        "--max-num-queued-requests", "100",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(bge_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bge_dir), device="cpu").encode(TEXTS, convert_to_numpy=True)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))


def test_embeddings_equal_sentence_transformers(embed_server, reference) -> None:
    response = _client(embed_server).embeddings.create(model="bge", input=TEXTS, encoding_format="float")
    got = np.array([item.embedding for item in response.data])
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    assert _cosines(got, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)  # the folder's Normalize module
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)


def test_base64_decodes_to_the_float_embeddings(embed_server) -> None:
    body = {"model": "bge", "input": TEXTS[:2]}
    _, _, floats = embed_server.request("POST", "/v1/embeddings", {**body, "encoding_format": "float"})
    status, _, encoded = embed_server.request("POST", "/v1/embeddings", {**body, "encoding_format": "base64"})
    assert status == 200
    for plain, packed in zip(floats["data"], encoded["data"]):
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(plain["embedding"], dtype=np.float32))
    # the openai client asks for base64 by default and decodes it itself
    default = _client(embed_server).embeddings.create(model="bge", input=TEXTS[:2])
    np.testing.assert_allclose([d.embedding for d in default.data], [d["embedding"] for d in floats["data"]])


def test_dimensions_truncate_and_renormalise(embed_server, reference) -> None:
    response = _client(embed_server).embeddings.create(model="bge", input=TEXTS[:3], dimensions=8)
    got = np.array([item.embedding for item in response.data])
    assert got.shape == (3, 8)
    want = reference[:3, :8] / np.linalg.norm(reference[:3, :8], axis=-1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_token_id_inputs_and_many_inputs_in_one_request(embed_server, bge_dir, reference) -> None:
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(bge_dir)(text)["input_ids"] for text in TEXTS]
    client = _client(embed_server)
    one = client.embeddings.create(model="bge", input=ids[0], encoding_format="float")
    assert _cosines(np.array(one.data[0].embedding), reference[0]) >= 0.9999
    many = client.embeddings.create(model="bge", input=ids * 10, encoding_format="float")  # 60 inputs: batched
    got = np.array([item.embedding for item in many.data])
    assert _cosines(got, np.tile(reference, (10, 1))).min() >= 0.9999


def test_concurrent_requests_each_get_their_own_embeddings(embed_server, reference) -> None:
    client = _client(embed_server)

    def one(i: int) -> np.ndarray:
        response = client.embeddings.create(model="bge", input=[TEXTS[i % len(TEXTS)]], encoding_format="float")
        return np.array(response.data[0].embedding)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(24)))
    for i, got in enumerate(results):
        assert _cosines(got, reference[i % len(TEXTS)]) >= 0.9999


def test_bad_inputs_and_other_tasks_are_refused_in_openai_format(embed_server) -> None:
    cases = [
        ({"model": "bge", "input": []}, "input"),
        ({"model": "bge", "input": "x", "dimensions": 1000}, "dimensions"),
        ({"model": "bge", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "bge", "input": [[1, 2], []]}, "input"),
        ({"model": "bge", "input": [[10**6]]}, "input"),
        ({"model": "bge", "input": " ".join(["cat"] * 300)}, "input"),  # longer than max_position_embeddings
    ]
    for body, param in cases:
        status, _, error = embed_server.request("POST", "/v1/embeddings", body)
        assert status == 400, (body, error)
        assert error["error"]["param"].startswith(param), error
    status, _, error = embed_server.request("POST", "/v1/embeddings", {"input": ["cat"] * 101})  # admission
    assert status == 400 and "--max-num-queued-requests" in error["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        _client(embed_server).completions.create(model="bge", prompt="hi", max_tokens=2)
    status, _, error = embed_server.request("POST", "/v1/rerank", {"query": "a", "documents": ["b"]})
    assert status == 400 and "--task score" in error["error"]["message"]
    status, _, error = embed_server.request("POST", "/v1/embeddings", {"model": "other", "input": "x"})
    assert status == 404


@pytest.fixture(scope="module")
def cross_server(cross_dir):
    server = start_server(
        str(cross_dir), "--runner", "pooling", "--served-model-name", "ce", "--tokenizer-pool-type", "thread"
    )
    yield server
    server.stop()


def test_cross_encoder_rerank_and_score_equal_sentence_transformers(cross_server, cross_dir) -> None:
    from sentence_transformers import CrossEncoder

    want = CrossEncoder(str(cross_dir), device="cpu").predict([(QUERY, text) for text in TEXTS])
    gaps = np.diff(np.sort(want))
    assert gaps.min() > 1e-4, want  # the order is well defined
    status, _, body = cross_server.request("POST", "/v1/rerank", {"model": "ce", "query": QUERY, "documents": TEXTS})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want))
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], np.sort(want)[::-1], atol=1e-5)
    assert body["results"][0]["document"] == {"text": TEXTS[int(np.argmax(want))]}
    status, _, top = cross_server.request(
        "POST",
        "/rerank",
        {"query": QUERY, "documents": [{"text": t} for t in TEXTS], "top_n": 2, "return_documents": False},
    )
    assert status == 200 and [r["index"] for r in top["results"]] == list(np.argsort(-want)[:2])
    assert top["results"][0]["document"] is None
    status, _, scores = cross_server.request("POST", "/v1/score", {"text_1": QUERY, "text_2": TEXTS})
    assert status == 200 and [d["object"] for d in scores["data"]] == ["score"] * len(TEXTS)
    np.testing.assert_allclose([d["score"] for d in scores["data"]], want, atol=1e-5)
    status, _, error = cross_server.request("POST", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert status == 400 and error["error"]["param"] == "text_2"
    status, _, error = cross_server.request("POST", "/v1/embeddings", {"input": "x"})
    assert status == 400 and "--task score" in error["error"]["message"]


def test_a_generation_server_refuses_the_pooling_routes() -> None:
    server = start_server("--tokenizer-pool-type", "thread")
    try:
        for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/rerank", {"query": "q", "documents": ["d"]})):
            status, _, error = server.request("POST", path, body)
            assert status == 400 and "--task embed" in error["error"]["message"], error
    finally:
        server.stop()
