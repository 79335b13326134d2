"""BERT-style bidirectional encoders (``BertModel``, ``XLMRobertaModel`` and their ``...ForSequenceClassification``
cross-encoders) over a padded batch, with torch SDPA.

Module and parameter names follow transformers (``embeddings.*``, ``encoder.layer.N.*``), except that query, key and
value are fused into one ``qkv`` projection at load time. XLM-RoBERTa differs from BERT only in its positions (they
start after ``pad_token_id``, as in fairseq) and its classification head (``classifier.dense`` + ``out_proj`` on the
first token, where BERT has a ``pooler`` + ``classifier``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.pooling.kernels import Dense

ENCODER_ARCHITECTURES = (
    "BertModel",
    "XLMRobertaModel",
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """The parts of a BERT/XLM-R ``config.json`` the encoder needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int
    num_labels: int

    @property
    def roberta(self) -> bool:
        return self.architecture.startswith("XLMRoberta")

    @property
    def classifier(self) -> bool:
        return self.architecture.endswith("ForSequenceClassification")

    @property
    def max_tokens(self) -> int:
        """The longest input: RoBERTa's positions start after the padding index."""
        return self.max_position_embeddings - (self.pad_token_id + 1 if self.roberta else 0)

    @staticmethod
    def from_model_dir(model_dir: Path) -> EncoderConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        architecture = (raw.get("architectures") or [""])[0]
        if architecture not in ENCODER_ARCHITECTURES:
            raise ValueError(f"{architecture!r} is not an encoder architecture ({', '.join(ENCODER_ARCHITECTURES)})")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported for encoders")
        labels = raw.get("id2label") or {}
        return EncoderConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            hidden_act=str(raw.get("hidden_act", "gelu")),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            pad_token_id=int(raw.get("pad_token_id") or 0),
            num_labels=int(raw.get("num_labels") or len(labels) or 2),
        )


class EncoderLayer(nn.Module):
    """Post-norm transformer block: self-attention, add & norm, GELU MLP, add & norm."""

    def __init__(self, config: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = Dense(hidden, 3 * hidden, dtype)
        self.attn_out = Dense(hidden, hidden, dtype)
        self.attn_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.up = Dense(hidden, config.intermediate_size, dtype)
        self.down = Dense(config.intermediate_size, hidden, dtype)
        self.out_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.approximate = "tanh" if config.hidden_act in _GELU_TANH else "none"
        if config.hidden_act not in (*_GELU_TANH, "gelu"):
            raise ValueError(f"encoder activation {config.hidden_act!r} is not supported (gelu, gelu_new)")

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], batch: int) -> torch.Tensor:
        """x: [batch * seq, hidden]; mask: [batch, 1, 1, seq] bool (True: a real token), None when every row is
        full -> [batch * seq, hidden]. The residual adds and the GELU run in the GEMMs' epilogues."""
        rows, hidden = x.shape
        head_dim = hidden // self.num_heads
        qkv = self.qkv(x).view(batch, rows // batch, 3, self.num_heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, seq, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_norm(self.attn_out.add(attn.transpose(1, 2).reshape(rows, hidden), x))
        return self.out_norm(self.down.add(self.up.gelu(x, self.approximate), x))


class Encoder(nn.Module):
    """Embeddings and encoder layers; ``forward`` gives the last hidden state, ``classify`` the head's logits."""

    def __init__(self, config: EncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), hidden, dtype=dtype)
        self.embed_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(config, dtype) for _ in range(config.num_layers))
        if config.classifier:
            # BERT: pooler (dense + tanh) then classifier; XLM-R: classifier.dense + tanh then classifier.out_proj
            self.head_dense = Dense(hidden, hidden, dtype)
            self.head_out = Dense(hidden, config.num_labels, dtype)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, token_types: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:  # input_ids, token_types: [batch, seq] right-padded; lengths: [batch] -> [batch, seq, hidden]
        batch, seq = input_ids.shape
        valid = torch.arange(seq, device=input_ids.device)[None, :] < lengths[:, None]  # [batch, seq]
        positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        if self.config.roberta:
            positions = positions + self.config.pad_token_id + 1
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embed_norm(x + self.token_type_embeddings(token_types)).reshape(batch * seq, -1)
        mask = None if bool(valid.all()) else valid[:, None, None, :]  # no mask: SDPA's fastest kernel
        for layer in self.layers:
            x = layer(x, mask, batch)
        return x.view(batch, seq, -1)

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [batch, seq, hidden] -> logits [batch, num_labels] float32, from the first token."""
        first = torch.tanh(self.head_dense(hidden[:, 0]))
        return self.head_out(first).float()

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers' tensors into this module (q/k/v fused); ValueError for anything left unfilled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for hf_name, tensor in weights:
            name = _map_encoder_name(hf_name, self.config.classifier)
            if name is None:
                continue
            if name.startswith("qkv:"):  # layers.N.qkv.{weight,bias} made of query, key and value
                target, part = name[4:].rsplit("|", 1)
                parts.setdefault(target, {})[part] = tensor
                if len(parts[target]) < 3:
                    continue
                tensor, name = torch.cat([parts[target][p] for p in ("query", "key", "value")]), target
            if name not in params or params[name].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name!r} does not fit this {self.config.architecture}")
            params[name].copy_(tensor)
            filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"the checkpoint does not provide {', '.join(missing[:5])}")


_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}
_EMBEDDING_NAMES = {
    "word_embeddings": "word_embeddings",
    "position_embeddings": "position_embeddings",
    "token_type_embeddings": "token_type_embeddings",
    "LayerNorm": "embed_norm",
}
_HEAD_NAMES = {
    "pooler.dense": "head_dense",  # BERT
    "classifier": "head_out",  # BERT (a Linear named classifier)
    "classifier.dense": "head_dense",  # XLM-R
    "classifier.out_proj": "head_out",  # XLM-R
}


def _map_encoder_name(hf_name: str, classifier: bool) -> Optional[str]:
    """Pagoda's parameter for a transformers tensor name; None for tensors that are skipped; ``qkv:target|part``
    for a part of a fused projection."""
    name = hf_name
    for prefix in ("bert.", "roberta.", "model."):
        name = name.removeprefix(prefix)
    module, _, leaf = name.rpartition(".")
    if leaf in ("position_ids", "token_type_ids"):  # buffers
        return None
    if module.startswith("embeddings."):
        mapped = _EMBEDDING_NAMES.get(module.removeprefix("embeddings."))
        return None if mapped is None else f"{mapped}.{leaf}"
    if module.startswith("encoder.layer."):
        index, _, rest = module.removeprefix("encoder.layer.").partition(".")
        if rest.startswith("attention.self."):
            return f"qkv:layers.{index}.qkv.{leaf}|{rest.removeprefix('attention.self.')}"
        mapped = _LAYER_NAMES.get(rest)
        return None if mapped is None else f"layers.{index}.{mapped}.{leaf}"
    if module in _HEAD_NAMES:
        return f"{_HEAD_NAMES[module]}.{leaf}" if classifier else None  # an embedder does not use the pooler
    return None if module.startswith("lm_head") else name
