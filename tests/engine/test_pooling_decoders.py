"""Decoder pooling models through a real `pagoda serve` and the official openai client, held to transformers:

- Qwen3-Embedding's shape: a bare ``Qwen3Model`` checkpoint (no ``model.`` prefix, no lm_head) embeds by its last
  token's final hidden state, L2-normalised (``--task embed``);
- Qwen3-Reranker's shape: a ``Qwen3ForCausalLM`` scored as its model card does: the card's prompt template, and
  p(yes) = softmax([logit(no), logit(yes)])[1] at the last token (``--task score``).

Tiny random-weight checkpoints with the tiny Qwen-style tokenizer of ``tiny_chat_model`` (no downloads).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from server_helpers import start_server
from tiny_chat_model import MAX_POSITION_EMBEDDINGS, build_tiny_chat_tokenizer
from tiny_checkpoints import build_tiny_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Model

from pagoda.pooling.model import RERANK_PREFIX, RERANK_SUFFIX, rerank_prompt

TEXTS = ["hello world", "the quick brown fox", '{"a": 1, "b": [true, false]}', "x", "numbers 12345 and words"]
QUERY = "what is a fox"


@pytest.fixture(scope="module")
def embedder_dir(tiny_chat_qwen3, tmp_path_factory) -> Path:
    """The tiny Qwen3 saved as the bare decoder, as Qwen3-Embedding checkpoints are."""
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    causal = AutoModelForCausalLM.from_pretrained(tiny_chat_qwen3, dtype=torch.float32)
    bare = Qwen3Model(causal.config)
    bare.load_state_dict(causal.model.state_dict())
    bare.config.architectures = ["Qwen3Model"]
    bare.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_chat_qwen3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3ForCausalLM whose tokenizer has "yes" and "no" as single tokens (as Qwen's has)."""
    folder = tmp_path_factory.mktemp("qwen3-reranker")
    tokenizer = build_tiny_chat_tokenizer()
    tokenizer.add_tokens(["yes", "no"])
    build_tiny_checkpoint(
        "qwen3",
        folder,
        torch.float32,
        seed=3,
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.save_pretrained(folder)
    return folder


def test_qwen3_embedding_equals_the_last_token_hidden_state(embedder_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(embedder_dir)
    model = Qwen3Model.from_pretrained(embedder_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [
            torch.nn.functional.normalize(
                model(torch.tensor([tokenizer(t)["input_ids"]])).last_hidden_state[0, -1], dim=0
            )
            for t in TEXTS
        ]
    server = start_server(
        str(embedder_dir), "--task", "embed", "--served-model-name", "q3e", "--tokenizer-pool-type", "thread"
    )
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        got = np.array([d.embedding for d in client.embeddings.create(model="q3e", input=TEXTS).data])
        want_np = torch.stack(want).numpy()
        cosines = (got * want_np).sum(-1) / np.linalg.norm(got, axis=-1)
        assert cosines.min() >= 0.9999
        small = client.embeddings.create(model="q3e", input=TEXTS, dimensions=16, encoding_format="float")
        truncated = want_np[:, :16] / np.linalg.norm(want_np[:, :16], axis=-1, keepdims=True)
        np.testing.assert_allclose([d.embedding for d in small.data], truncated, atol=1e-5)
        with pytest.raises(openai.BadRequestError, match="pooling model"):
            client.chat.completions.create(model="q3e", messages=[{"role": "user", "content": "hi"}])
    finally:
        server.stop()


def _card_scores(reranker_dir: Path, documents: list[str]) -> np.ndarray:
    """The Qwen3-Reranker model card's recipe, with transformers."""
    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    model = AutoModelForCausalLM.from_pretrained(reranker_dir, dtype=torch.float32).eval()
    prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    with torch.no_grad():
        for doc in documents:
            middle = tokenizer(rerank_prompt(QUERY, doc), add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([prefix + middle + suffix])).logits[0, -1]
            scores.append(torch.softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].item())
    return np.array(scores)


def test_qwen3_reranker_order_equals_the_model_card_recipe(reranker_dir) -> None:
    want = _card_scores(reranker_dir, TEXTS)
    assert np.diff(np.sort(want)).min() > 1e-4, want  # the order is well defined
    server = start_server(
        str(reranker_dir), "--task", "score", "--served-model-name", "q3r", "--tokenizer-pool-type", "thread"
    )
    try:
        status, _, body = server.request("POST", "/v1/rerank", {"model": "q3r", "query": QUERY, "documents": TEXTS})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == list(np.argsort(-want))
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], np.sort(want)[::-1], atol=1e-5)
        status, _, scores = server.request(
            "POST", "/v1/score", {"model": "q3r", "text_1": [QUERY] * 2, "text_2": TEXTS[:2]}
        )
        assert status == 200
        np.testing.assert_allclose([d["score"] for d in scores["data"]], want[:2], atol=1e-5)
    finally:
        server.stop()
