"""Convert a Hugging Face Qwen3 safetensors checkpoint into a GGUF file llama.cpp loads (BF16, Q8_0, Q4_0, Q4_K_M).

Runs in the llama.cpp virtual environment (``numpy`` and ``gguf``; no torch): the safetensors files are
parsed by hand so BF16 weights are copied bit-for-bit. The tokenizer section is a minimal
SentencePiece-style ("llama") vocabulary — the benchmark feeds token ids directly, so it only has to load.

BF16 and Q8_0 are written here. Q4_0 and Q4_K_M are made the way llama.cpp users make them: the BF16 GGUF
quantized by llama.cpp's own quantizer (``llama_model_quantize`` through llama-cpp-python), with its default
per-tensor choices (for example the tied token embedding, which is also the output matrix, becomes Q6_K in
both; Q4_K_M also keeps ``attn_v`` and ``ffn_down`` of half the layers, 14 of 28 here, in Q6_K).

    python gguf_export.py --model DIR [--quant bf16|q8_0|q4_0|q4_k_m] [--out FILE]

Without ``--out`` the file is cached as ``DIR/ggml-model-<quant>.gguf`` and reused when present.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_QUANTS = {
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# Made from the BF16 GGUF by llama.cpp's quantizer: --quant -> the LLAMA_FTYPE_MOSTLY_* constant's name.
_LLAMA_CPP_FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def gguf_path(model_dir: Path, quant: str) -> Path:
    """Where the cached GGUF for ``quant`` lives next to the checkpoint."""
    return model_dir / f"ggml-model-{quant}.gguf"


def gguf_name(hf_name: str) -> str:
    """Map a Hugging Face Qwen3 tensor name to the name llama.cpp's qwen3 loader expects."""
    base, _, suffix = hf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"]:
        layer, rest = parts[2], ".".join(parts[3:])
        if rest in _LAYER_NAMES:
            return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"
    raise KeyError(f"unexpected tensor {hf_name!r}")


def read_safetensors(model_dir: Path) -> Iterator[tuple[str, str, np.ndarray]]:
    """Yield (name, safetensors dtype, array) for every tensor; BF16 comes back as raw uint16 bits."""
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            array = data[start:end].view(_NP_DTYPES[info["dtype"]]).reshape(info["shape"])
            yield name, info["dtype"], array


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a safetensors array (BF16 given as uint16 bits) to float32."""
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def encode_tensor(array: np.ndarray, dtype: str, quant: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Encode one tensor: 1-D tensors (norms) stay F32, matrices become BF16 (bit-exact copy) or Q8_0."""
    if array.ndim == 1:
        return to_float32(array, dtype), gguf.GGMLQuantizationType.F32
    qtype = _QUANTS[quant][0]
    if quant == "bf16" and dtype == "BF16":
        raw = np.ascontiguousarray(array).view(np.uint8)  # byte shape; the writer turns it back into elements
        return raw, qtype
    return gguf.quants.quantize(to_float32(array, dtype), qtype), qtype


def _rope_theta(config: dict) -> float:
    """rope_theta from either the classic key or transformers 5's ``rope_parameters``."""
    if "rope_theta" in config:
        return float(config["rope_theta"])
    return float((config.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0))


def add_hparams(writer: gguf.GGUFWriter, config: dict, quant: str) -> None:
    """The qwen3 architecture metadata llama.cpp reads."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(Path(config.get("_name_or_path") or "qwen3").name or "qwen3")
    writer.add_file_type(_QUANTS[quant][1])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))


def vocab_tokens(model_dir: Path, vocab_size: int) -> list[str]:
    """Token strings by id: the checkpoint's tokenizer.json vocabulary where it has one, ``w<i>`` otherwise."""
    tokens = [f"w{i}" for i in range(vocab_size)]
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.exists():
        model = json.loads(tokenizer_file.read_text()).get("model", {})
        vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
        for token, index in vocab.items():
            if 0 <= index < vocab_size:
                tokens[index] = token
    seen: set[str] = set()
    for index, token in enumerate(tokens):  # llama.cpp maps text -> id, so keep them unique
        if token in seen:
            tokens[index] = f"<dup{index}>"
        seen.add(tokens[index])
    return tokens


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    """A minimal SentencePiece-style vocabulary: ids 0/1/2 are unk/bos/eos, the rest normal tokens."""
    vocab_size = config["vocab_size"]
    bos, eos = int(config.get("bos_token_id") or 1), int(config.get("eos_token_id") or 2)
    types = [gguf.TokenType.NORMAL] * vocab_size
    types[0] = gguf.TokenType.UNKNOWN
    types[bos] = types[eos] = gguf.TokenType.CONTROL
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab_tokens(model_dir, vocab_size))
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(int(config.get("pad_token_id") or 0))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def export(model_dir: Path, quant: str, out: Path) -> Path:
    """Write ``out`` from the checkpoint in ``model_dir``; returns ``out``."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "qwen3":
        raise ValueError(f"only qwen3 checkpoints are supported, got {config.get('model_type')!r}")
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch="qwen3")
    add_hparams(writer, config, quant)
    add_tokenizer(writer, model_dir, config)
    tied = config.get("tie_word_embeddings", True)
    for name, dtype, array in read_safetensors(model_dir):
        if name == "lm_head.weight" and tied:
            continue
        data, qtype = encode_tensor(array, dtype, quant)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    return out


def quantize_with_llama_cpp(source: Path, quant: str, out: Path, threads: int = 0) -> Path:
    """Quantize the GGUF ``source`` to ``out`` with llama.cpp's own quantizer (``quant`` in q4_0, q4_k_m).

    ``threads`` 0 lets llama.cpp use every core. Written aside and renamed, like :func:`export`.
    """
    import ctypes

    import llama_cpp as ll

    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, _LLAMA_CPP_FTYPES[quant])
    params.nthread = threads
    partial = out.with_name(out.name + ".partial")
    status = ll.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source.name} -> {quant}) failed with status {status}")
    partial.rename(out)
    return out


def ensure_gguf(model_dir: Path, quant: str) -> Path:
    """The cached GGUF for ``quant``, exporting (and for Q4 quantizing the BF16 one) first if it is missing."""
    path = gguf_path(model_dir, quant)
    if not path.exists():
        print(f"[gguf_export] writing {path}", file=sys.stderr, flush=True)
        if quant in _LLAMA_CPP_FTYPES:
            quantize_with_llama_cpp(ensure_gguf(model_dir, "bf16"), quant, path)
        else:
            export(model_dir, quant, path)
    return path


def main() -> None:
    """Command line: export one checkpoint to GGUF."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF Qwen3 checkpoint directory")
    parser.add_argument("--quant", choices=sorted([*_QUANTS, *_LLAMA_CPP_FTYPES]), default="bf16")
    parser.add_argument("--out", default=None, help="output file (default: cached next to the checkpoint)")
    args = parser.parse_args()
    model_dir = Path(args.model)
    if args.out and args.quant in _LLAMA_CPP_FTYPES:
        print(quantize_with_llama_cpp(ensure_gguf(model_dir, "bf16"), args.quant, Path(args.out)))
    elif args.out:
        print(export(model_dir, args.quant, Path(args.out)))
    else:
        print(ensure_gguf(model_dir, args.quant))


if __name__ == "__main__":
    main()
