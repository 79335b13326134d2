"""A pooling model: which network, how its hidden states become an embedding or a score, and the forward itself.

What a checkpoint does is read from its files, as sentence-transformers and vLLM read them:

- encoders (:mod:`pagoda.pooling.encoder`): ``BertModel`` / ``XLMRobertaModel`` embed with the pooling of the
  sentence-transformers folder (``modules.json`` -> ``1_Pooling/config.json``: CLS or mean; default CLS) and are
  L2-normalised when it has a ``Normalize`` module (default: normalised); ``...ForSequenceClassification``
  cross-encoders score a pair (sigmoid of the one logit, as sentence-transformers' ``CrossEncoder``; with two
  labels the softmax's second), and an embedding encoder scores a pair by the cosine of the two embeddings.
- decoders (:mod:`pagoda.pooling.decoder`, Qwen3-Embedding's shape): last-token pooling, normalised; with
  ``--task score`` the Qwen3-Reranker recipe: its prompt template, and p(yes) = softmax([logit(no), logit(yes)])[1]
  at the prompt's last token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagoda.model_config import ModelConfig
from pagoda.pooling.decoder import DecoderPooler, decoder_architectures, load_decoder
from pagoda.pooling.encoder import ENCODER_ARCHITECTURES, Encoder, EncoderConfig

POOLING_MODES = ("cls", "mean", "last")
# The Qwen3-Reranker model card's prompt (its instruction is the card's default).
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def rerank_prompt(query: str, document: str, instruction: str = RERANK_INSTRUCTION) -> str:
    """The middle of the Qwen3-Reranker prompt (between :data:`RERANK_PREFIX` and :data:`RERANK_SUFFIX`)."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """What one checkpoint computes, read from its files."""

    task: str  # embed | score
    kind: str  # encoder | decoder
    pooling: str  # cls | mean | last (embeddings; cosine scores)
    normalize: bool
    hidden_size: int
    max_tokens: int  # longest input (the model's positions)
    scorer: Optional[str] = None  # score task: classifier | yes_no | cosine


def sentence_transformers_pooling(model_dir: Path, default: str) -> tuple[str, bool]:
    """(pooling mode, normalise) of a sentence-transformers folder; ``(default, True)`` without ``modules.json``."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return default, True
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    types = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unsupported = sorted(set(types) - {"Transformer", "Pooling", "Normalize"})
    if unsupported:
        raise ValueError(f"sentence-transformers modules {', '.join(unsupported)} are not supported for pooling")
    mode = default
    for module, kind in zip(modules, types):
        if kind == "Pooling":
            config = json.loads((model_dir / str(module.get("path", "")) / "config.json").read_text())
            # sentence-transformers >= 6 writes "pooling_mode": "mean"; older versions one boolean per mode
            named = _POOLING_NAMES.get(str(config.get("pooling_mode")))
            modes = [named] if named else [m for m, key in _POOLING_KEYS.items() if config.get(key)]
            if len(modes) != 1:
                raise ValueError(f"pooling config {modes or 'without a mode'}: exactly one of cls, mean, lasttoken")
            mode = modes[0]
    return mode, "Normalize" in types


_POOLING_NAMES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}


class PoolingModel:
    """The network and its pooling; :meth:`embed` and :meth:`score` run one padded batch (on the caller's thread)."""

    def __init__(
        self,
        spec: PoolingSpec,
        network: torch.nn.Module,
        device: torch.device,
        yes_no: Optional[torch.Tensor] = None,  # [2, hidden]: the reranker's lm_head rows of "no" and "yes"
    ) -> None:
        self.spec = spec
        self.network = network
        self.device = device
        self.yes_no = yes_no

    def _padded(self, inputs: list[list[int]], token_types: Optional[list[list[int]]]):
        lengths = torch.tensor([len(ids) for ids in inputs], dtype=torch.int64)
        seq = int(lengths.max())
        ids = torch.zeros(len(inputs), seq, dtype=torch.int64)
        types = torch.zeros(len(inputs), seq, dtype=torch.int64)
        for row, sequence in enumerate(inputs):
            ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.int64)
            if token_types is not None and token_types[row]:
                types[row, : len(sequence)] = torch.tensor(token_types[row], dtype=torch.int64)
        return ids.to(self.device), types.to(self.device), lengths.to(self.device)

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Token-id lists -> embeddings [n, hidden] float32 on the CPU (normalised when the model is)."""
        ids, types, lengths = self._padded(inputs, None)
        if self.spec.kind == "decoder":
            pooled = self.network(ids, lengths).float()
        else:
            hidden = self.network(ids, types, lengths).float()  # [n, seq, hidden]
            pooled = _pool(hidden, lengths, self.spec.pooling)
        if self.spec.normalize:
            pooled = F.normalize(pooled, dim=-1)
        return pooled.cpu()

    @torch.inference_mode()
    def score(self, inputs: list[list[int]], token_types: Optional[list[list[int]]] = None) -> torch.Tensor:
        """Prompts (a pair each: a cross-encoder's, or the reranker's template) -> scores [n] float32."""
        ids, types, lengths = self._padded(inputs, token_types)
        if self.spec.scorer == "yes_no":
            assert self.yes_no is not None
            last = self.network(ids, lengths)  # [n, hidden]
            logits = (last @ self.yes_no.T).float()  # [n, 2]: no, yes
            return torch.softmax(logits, dim=-1)[:, 1].cpu()
        assert self.spec.scorer == "classifier", self.spec
        logits = self.network.classify(self.network(ids, types, lengths))  # [n, num_labels]
        if logits.shape[1] == 1:
            return torch.sigmoid(logits[:, 0]).cpu()
        return torch.softmax(logits, dim=-1)[:, 1].cpu()


def _pool(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [n, seq, hidden] -> [n, hidden] by CLS, mean over the real tokens, or the last real token."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    valid = (torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]).to(hidden.dtype)
    return (hidden * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)


def architecture_of(model_dir: Path) -> str:
    """The first ``architectures`` entry of ``config.json`` (empty when it has none)."""
    raw = json.loads((model_dir / "config.json").read_text())
    return str((raw.get("architectures") or [""])[0])


def load_pooling_model(
    model_dir: Path, task: str, dtype: torch.dtype, device: torch.device, tokenizer: Any
) -> PoolingModel:
    """The checkpoint of ``model_dir`` for ``task`` (embed | score); ValueError for an unsupported combination."""
    architecture = architecture_of(model_dir)
    if architecture in ENCODER_ARCHITECTURES:
        return _load_encoder(model_dir, task, dtype, device)
    if architecture in decoder_architectures():
        return _load_decoder(model_dir, task, dtype, device, tokenizer)
    raise ValueError(
        f"architecture {architecture!r} cannot serve --task {task}; pooling supports "
        f"{', '.join([*ENCODER_ARCHITECTURES, *decoder_architectures()])}"
    )


def _load_encoder(model_dir: Path, task: str, dtype: torch.dtype, device: torch.device) -> PoolingModel:
    from pagoda.loader import iterate_safetensors

    config = EncoderConfig.from_model_dir(model_dir)
    if task == "embed" and config.classifier:
        raise ValueError(f"{config.architecture} is a cross-encoder: serve it with --task score")
    pooling, normalize = sentence_transformers_pooling(model_dir, "cls")
    scorer = ("classifier" if config.classifier else "cosine") if task == "score" else None
    spec = PoolingSpec(task, "encoder", pooling, normalize, config.hidden_size, config.max_tokens, scorer)
    with torch.device(device):
        network = Encoder(config, dtype)
    network.load_weights((name, tensor.to(dtype)) for name, tensor in iterate_safetensors(model_dir, device))
    return PoolingModel(spec, network.eval(), device)


def _load_decoder(model_dir: Path, task: str, dtype: torch.dtype, device: torch.device, tokenizer: Any) -> PoolingModel:
    config = ModelConfig.from_model_dir(model_dir)
    pooling, normalize = sentence_transformers_pooling(model_dir, "last")
    if pooling != "last":
        raise ValueError(f"decoders pool their last token; the checkpoint asks for {pooling} pooling")
    scorer = "yes_no" if task == "score" else None
    spec = PoolingSpec(task, "decoder", "last", normalize, config.hidden_size, config.max_position_embeddings, scorer)
    network: DecoderPooler = load_decoder(config, dtype, device, keep_lm_head=scorer == "yes_no")
    yes_no = None
    if scorer == "yes_no":
        yes_no = network.head_rows([_single_token(tokenizer, "no"), _single_token(tokenizer, "yes")])
        network.drop_lm_head()
    return PoolingModel(spec, network, device, yes_no)


def _single_token(tokenizer: Any, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"a yes/no reranker needs {word!r} to be one token; this tokenizer makes {len(ids)}")
    return int(ids[0])
