"""Convert a Hugging Face Qwen3 or Qwen3-MoE safetensors checkpoint into a GGUF file llama.cpp loads (BF16, Q8_0,
Q4_0, Q4_K_M).

Runs in the llama.cpp virtual environment (``numpy`` and ``gguf``; no torch): the safetensors files are
parsed by hand so BF16 weights are copied bit-for-bit. The tokenizer section is a minimal
SentencePiece-style ("llama") vocabulary — the benchmark feeds token ids directly, so it only has to load.

BF16 and Q8_0 are written here. Q4_0 and Q4_K_M are made the way llama.cpp users make them: the BF16 GGUF
quantized by llama.cpp's own quantizer (``llama_model_quantize`` through llama-cpp-python), with its default
per-tensor choices (for example the tied token embedding, which is also the output matrix, becomes Q6_K in
both; Q4_K_M also keeps ``attn_v`` and ``ffn_down`` of half the layers, 14 of 28 here, in Q6_K).

    python gguf_export.py --model DIR [--quant bf16|q8_0|q4_0|q4_k_m] [--out FILE]

Qwen3-MoE (``model_type`` qwen3_moe) becomes llama.cpp's ``qwen3moe`` architecture, laid out as its own converter
lays it out: the router ``mlp.gate`` is ``ffn_gate_inp`` (kept F32, as llama.cpp keeps it), and each layer's
per-expert ``experts.{e}.gate_proj/up_proj/down_proj`` are stacked into one ``ffn_gate_exps`` / ``ffn_up_exps``
[E, moe_intermediate, hidden] and ``ffn_down_exps`` [E, hidden, moe_intermediate] tensor, with ``expert_count``,
``expert_used_count`` and ``expert_feed_forward_length`` in the metadata. llama.cpp's qwen3moe graph always
renormalises the top-k weights and has no dense layers, so a config with ``norm_topk_prob`` false or
``mlp_only_layers`` / ``decoder_sparse_step`` > 1 is refused rather than converted into a different model.

Without ``--out`` the file is cached as ``DIR/ggml-model-<quant>.gguf`` and reused when present.
"""

from __future__ import annotations

import argparse
import json
import re
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
    "mlp.gate": "ffn_gate_inp",  # the MoE router [experts, hidden]
}
# One per-expert projection of a Qwen3-MoE layer: stacked over the experts into llama.cpp's *_exps tensor.
_EXPERT = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$"
)
_ARCHES = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe"}  # HF model_type -> llama.cpp architecture
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


def num_experts(config: dict) -> int:
    """Routed experts of a Qwen3-MoE config (the Hub's ``num_experts``; transformers 5 writes ``num_local_experts``)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def check_moe_config(config: dict) -> None:
    """ValueError for a Qwen3-MoE config llama.cpp's qwen3moe graph would compute differently."""
    if not config.get("norm_topk_prob", False):
        raise ValueError("llama.cpp's qwen3moe always renormalises the top-k weights; norm_topk_prob is false")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        raise ValueError("llama.cpp's qwen3moe has no dense layers (mlp_only_layers / decoder_sparse_step > 1)")


def add_hparams(writer: gguf.GGUFWriter, config: dict, quant: str) -> None:
    """The qwen3 / qwen3moe architecture metadata llama.cpp reads."""
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
    if config.get("model_type") == "qwen3_moe":
        writer.add_expert_count(num_experts(config))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))


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


def gguf_tensors(model_dir: Path, config: dict) -> Iterator[tuple[str, str, np.ndarray]]:
    """(GGUF name, safetensors dtype, array) for every tensor llama.cpp reads, in checkpoint order; a layer's
    per-expert projections come out once, stacked over the experts (wherever the shards put them)."""
    tensors = {name: (dtype, array) for name, dtype, array in read_safetensors(model_dir)}
    tied = config.get("tie_word_embeddings", True)
    stacked: set[tuple[str, str]] = set()
    for name, (dtype, array) in tensors.items():
        if name == "lm_head.weight" and tied:
            continue
        expert = _EXPERT.match(name)
        if expert is None:
            yield gguf_name(name), dtype, array
            continue
        layer, proj = expert["layer"], expert["proj"]
        if (layer, proj) in stacked:
            continue
        stacked.add((layer, proj))
        names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight" for e in range(num_experts(config))]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise KeyError(f"checkpoint lacks {missing[0]!r} ({len(missing)} expert tensors missing)")
        # [E, out, in]: ggml's [in, out, E], the shape llama.cpp's loader asks for.
        yield f"blk.{layer}.ffn_{proj}_exps.weight", dtype, np.stack([tensors[n][1] for n in names])


def export(model_dir: Path, quant: str, out: Path) -> Path:
    """Write ``out`` from the checkpoint in ``model_dir``; returns ``out``."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in _ARCHES:
        raise ValueError(f"only {' and '.join(_ARCHES)} checkpoints are supported, got {model_type!r}")
    moe = model_type == "qwen3_moe"
    if moe:
        check_moe_config(config)
    partial = out.with_name(out.name + ".partial")
    # MoE: each stacked expert tensor goes to a spooled file as it is added, so at most one is held in memory.
    writer = gguf.GGUFWriter(partial, arch=_ARCHES[model_type], use_temp_file=moe)
    add_hparams(writer, config, quant)
    add_tokenizer(writer, model_dir, config)
    for name, dtype, array in gguf_tensors(model_dir, config):
        if name.endswith("ffn_gate_inp.weight"):  # the router stays F32 (lossless from BF16), as llama.cpp keeps it
            data, qtype = to_float32(array, dtype), gguf.GGMLQuantizationType.F32
        else:
            data, qtype = encode_tensor(array, dtype, quant)
        writer.add_tensor(name, data, raw_dtype=qtype)
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
    parser.add_argument("--model", required=True, help="HF Qwen3 or Qwen3-MoE checkpoint directory")
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
