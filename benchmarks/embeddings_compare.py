"""Embeddings throughput on the CPU: Pagoda's pooling engine against sentence-transformers, same host, one run.

Builds (in a temporary folder, no downloads) a BERT-base-shaped random-weight embedder from a transformers config
(12 layers, hidden 768, 12 heads, intermediate 3072, WordPiece vocabulary of 30522) saved as a sentence-transformers
folder (CLS pooling + Normalize, as bge), and embeds the same texts of exactly 128 tokens each ([CLS] + 126 words +
[SEP]) in batches of 32 with both:

- sentence-transformers: ``SentenceTransformer.encode(texts, batch_size=32)`` (tokenizing included);
- Pagoda: the tokenizer's batch call, then ``PoolingEngine.run`` (the pooling engine's forward, as the worker thread
  runs it: padded batch, fused QKV, the engine's linear kernels) on each batch of 32.

Both run in this process with the same torch threads and dtype; each side's best of ``--repeats`` timed passes (after
a warm-up batch) counts. Prints inputs/s of each, the ratio, the cosine between their embeddings, and the CPU flags.

    python benchmarks/embeddings_compare.py                  # bf16 (the engine's CPU dtype with AVX512-BF16/AMX)
    python benchmarks/embeddings_compare.py --dtype float32  # both in float32
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch

BERT_BASE = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512
)
VOCAB_SIZE = 30522
TOKENS_PER_INPUT = 128
BATCH = 32


def build_embedder(out_dir: Path, layers: int) -> Path:
    """A bge-shaped sentence-transformers folder with random weights and a word-level WordPiece vocabulary."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    raw = out_dir / "raw"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB_SIZE - 5)]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    special = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(raw)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB_SIZE, **{**BERT_BASE, "num_hidden_layers": layers})
    BertModel(config).save_pretrained(raw)
    transformer = st_models.Transformer(str(raw), max_seq_length=512)
    pooling = st_models.Pooling(BERT_BASE["hidden_size"], pooling_mode="cls")
    folder = out_dir / "st"
    SentenceTransformer(modules=[transformer, pooling, st_models.Normalize()], device="cpu").save(str(folder))
    return folder


def texts(count: int) -> list[str]:
    """Texts of exactly TOKENS_PER_INPUT tokens each (every word is one token), all different."""
    words = TOKENS_PER_INPUT - 2
    return [" ".join(f"w{(i * 131 + j * 7) % (VOCAB_SIZE - 5)}" for j in range(words)) for i in range(count)]


def best_rate(run, count: int, repeats: int) -> tuple[float, object]:
    """inputs/s of the fastest of ``repeats`` passes of ``run()`` over ``count`` inputs, and its last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return count / best, result


def pagoda_runner(folder: Path, dtype: str):
    from pagoda.config import EngineArgs
    from pagoda.pooling.engine import PoolingEngine, PoolInput

    engine = PoolingEngine(EngineArgs(model=str(folder), task="embed", dtype=dtype, device="cpu"))

    def embed(batch: list[str]) -> torch.Tensor:
        ids = engine.tokenizer(batch)["input_ids"]
        return torch.stack(engine.run("embed", [PoolInput(list(i)) for i in ids]))

    return engine, embed


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = sorted(set(re.findall(r"\b(avx2|avx512f|avx512_bf16|amx_tile)\b", text)))
    return " ".join(found) or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--inputs", type=int, default=128, help="inputs per timed pass (a multiple of 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=BERT_BASE["num_hidden_layers"])
    ns = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    dtype = getattr(torch, ns.dtype)
    workload = texts(ns.inputs)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_embedder(Path(tmp), ns.layers)
        st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})
        engine, pagoda_embed = pagoda_runner(folder, ns.dtype)
        batches = [workload[i : i + BATCH] for i in range(0, len(workload), BATCH)]
        assert len(engine.tokenizer(workload[0])["input_ids"]) == TOKENS_PER_INPUT
        with torch.inference_mode():
            st.encode(batches[0], batch_size=BATCH)  # warm-up (oneDNN primitives, allocator)
            pagoda_embed(batches[0])
            st_rate, st_out = best_rate(
                lambda: st.encode(workload, batch_size=BATCH, convert_to_tensor=True), len(workload), ns.repeats
            )
            pagoda_rate, pagoda_out = best_rate(
                lambda: torch.cat([pagoda_embed(b) for b in batches]), len(workload), ns.repeats
            )
        cosine = torch.nn.functional.cosine_similarity(st_out.float(), pagoda_out.float(), dim=-1).min().item()
    print(f"model: BERT-base shape ({ns.layers} layers, hidden 768), random weights, {ns.dtype}")
    print(f"workload: {len(workload)} inputs of {TOKENS_PER_INPUT} tokens, batch {BATCH}, torch threads "
          f"{torch.get_num_threads()}, best of {ns.repeats}")  # fmt: skip
    print(f"cpu flags: {cpu_flags()}")
    print(f"pagoda linear kernels: {engine.linear_kernels}")
    print(f"sentence-transformers: {st_rate:8.2f} inputs/s")
    print(f"pagoda pooling engine: {pagoda_rate:8.2f} inputs/s")
    print(f"ratio pagoda / sentence-transformers: {pagoda_rate / st_rate:.2f}x (target >= 1.5x)")
    print(f"min cosine between the two embeddings: {cosine:.6f}")


if __name__ == "__main__":
    main()
