"""Tiny random-weight pooling checkpoints built locally (no downloads): a BERT WordPiece tokenizer, a bge-shaped
sentence-transformers folder (BertModel + mean Pooling + Normalize) and a BERT cross-encoder."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertForSequenceClassification, BertModel, PreTrainedTokenizerFast

WORDS = [
    *("the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by", "an"),
    *("be", "this", "are", "from", "or", "have", "not", "but", "what", "all", "were", "when", "we", "there", "can"),
    *("more", "if", "out", "so", "up", "cat", "dog", "mat", "sat", "ran", "big", "small", "red", "blue", "sun", "moon"),
]
BERT_SHAPE = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=128
)


def write_wordpiece_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """A BERT-style (uncased WordPiece, [CLS] a [SEP] b [SEP] with token types) tokenizer saved to ``out_dir``."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789.,!?", *WORDS]
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with seeded random weights large enough that pooling and attention choices show in the outputs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "LayerNorm.weight" in name else 0.0, 0.3 if "LayerNorm" in name else 0.2)
    return model.eval()


def build_bge_folder(raw: Path, folder: Path) -> Path:
    """A bge-shaped sentence-transformers folder in ``folder`` (``raw``: scratch space for the bare BertModel):
    ``modules.json``, ``1_Pooling/config.json`` (mean), a Normalize module."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models

    tokenizer = write_wordpiece_tokenizer(raw)
    randomised(BertModel(BertConfig(vocab_size=len(tokenizer), **BERT_SHAPE)), 0).save_pretrained(raw)
    transformer = st_models.Transformer(str(raw), max_seq_length=128)
    pooling = st_models.Pooling(BERT_SHAPE["hidden_size"], pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, st_models.Normalize()], device="cpu").save(str(folder))
    return folder


def build_cross_encoder(folder: Path) -> Path:
    """A one-label BERT cross-encoder (BertForSequenceClassification) in ``folder``."""
    tokenizer = write_wordpiece_tokenizer(folder)
    config = BertConfig(vocab_size=len(tokenizer), num_labels=1, **BERT_SHAPE)
    randomised(BertForSequenceClassification(config), 1).save_pretrained(folder)
    return folder
