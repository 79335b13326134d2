"""The pooling networks in-process against transformers: XLM-RoBERTa (its offset positions and its classification
head), padded batches of mixed lengths, and the bf16 CPU kernels (oneDNN packed weights, GELU and residual adds
fused into the GEMMs) against the float32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaModel

from pagoda.layers.cpu_linear import onednn_packing_available
from pagoda.pooling.kernels import prepare_pooling_kernels
from pagoda.pooling.model import load_pooling_model

_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
INPUTS = [[0, 5, 6, 7, 8, 9, 10, 2], [0, 11, 12, 2], [0, 13, 2]]  # mixed lengths: padded, masked rows
CPU = torch.device("cpu")


def _save(model: torch.nn.Module, folder: Path) -> Path:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.2)
    model.eval().save_pretrained(folder)
    return folder


def test_xlm_roberta_embeddings_equal_transformers_cls(tmp_path: Path) -> None:
    config = XLMRobertaConfig(vocab_size=64, max_position_embeddings=40, pad_token_id=1, **_SHAPE)
    reference = XLMRobertaModel(config, add_pooling_layer=False)
    folder = _save(reference, tmp_path / "xlmr")
    got = load_pooling_model(folder, "embed", torch.float32, CPU, None).embed(INPUTS)
    with torch.no_grad():
        want = [F.normalize(reference(torch.tensor([ids])).last_hidden_state[0, 0], dim=0) for ids in INPUTS]
    torch.testing.assert_close(got, torch.stack(want), atol=2e-6, rtol=0)


def test_xlm_roberta_cross_encoder_equals_transformers(tmp_path: Path) -> None:
    config = XLMRobertaConfig(vocab_size=64, max_position_embeddings=40, pad_token_id=1, num_labels=1, **_SHAPE)
    reference = XLMRobertaForSequenceClassification(config)
    folder = _save(reference, tmp_path / "xlmr-ce")
    got = load_pooling_model(folder, "score", torch.float32, CPU, None).score(INPUTS)
    with torch.no_grad():
        want = [torch.sigmoid(reference(torch.tensor([ids])).logits[0, 0]) for ids in INPUTS]
    torch.testing.assert_close(got, torch.stack(want), atol=2e-6, rtol=0)


def test_an_embed_task_refuses_a_cross_encoder(tmp_path: Path) -> None:
    config = XLMRobertaConfig(vocab_size=64, max_position_embeddings=40, pad_token_id=1, num_labels=1, **_SHAPE)
    folder = _save(XLMRobertaForSequenceClassification(config), tmp_path / "ce")
    with pytest.raises(ValueError, match="--task score"):
        load_pooling_model(folder, "embed", torch.float32, CPU, None)


@pytest.mark.skipif(not onednn_packing_available(torch.bfloat16), reason="this CPU has no oneDNN bf16")
def test_bf16_fused_kernels_stay_close_to_float32(tmp_path: Path) -> None:
    folder = _save(BertModel(BertConfig(vocab_size=64, max_position_embeddings=40, **_SHAPE)), tmp_path / "bert")
    want = load_pooling_model(folder, "embed", torch.float32, CPU, None).embed(INPUTS)
    model = load_pooling_model(folder, "embed", torch.bfloat16, CPU, None)
    counts = prepare_pooling_kernels(model.network, CPU, torch.bfloat16)
    assert counts == {"onednn-packed-fused": 4 * _SHAPE["num_hidden_layers"]}
    got = model.embed(INPUTS)
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.999
