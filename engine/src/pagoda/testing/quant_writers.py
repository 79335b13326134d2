"""Write AWQ, GPTQ and compressed-tensors FP8 checkpoints from a float safetensors checkpoint (tests, benchmarks).

Every decoder-layer linear weight (``q/k/v/o_proj``, ``gate/up/down_proj``) is quantized by round to nearest into the
format the real tools publish (tensor names, dtypes, packing and config.json's ``quantization_config``); everything
else (embeddings, norms, biases, ``lm_head``) is copied unchanged, as are the tokenizer and generation files. The
weights are not calibrated (no AWQ scale search, no GPTQ error feedback), which changes their values, not their
format: a loader that reads these reads the published checkpoints.

Round to nearest keeps ``|w - dequantized| <= scale / 2`` for every element: the integer grid always covers the
group's range (zero included), and fp16 scales are rounded *up* from the float32 ones so the grid never shrinks.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from pagoda.quantization.formats import AWQ_PACK_ORDER
from pagoda.quantization.weights import FP8_E4M3_MAX

_INDEX = "model.safetensors.index.json"
_TARGET = re.compile(
    r"^(?P<module>.*\.layers\.(?P<layer>\d+)\.(?:self_attn\.(?P<attn>[qkvo])_proj|mlp\.(?:experts\.\d+\.)?(?P<mlp>gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.(?P<mixtral>w[123])))"
    r"\.weight$"
)
_MIXTRAL_ROLES = {"w1": "gate", "w3": "up", "w2": "down"}  # Mixtral's expert projections as the Hub names them
# Act order permutes a layer's inputs: projections that read the same activations share one permutation.
_INPUT_GROUP = {"q": 0, "k": 0, "v": 0, "o": 1, "gate": 2, "up": 2, "down": 3}


@dataclass(frozen=True)
class _Options:
    method: str
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    fp8_weight_strategy: str
    fp8_static_activations: bool
    seed: int


def write_quantized_checkpoint(
    src: Path,
    dst: Path,
    method: str,
    *,
    bits: int = 4,
    group_size: int = 128,
    sym: Optional[bool] = None,
    desc_act: bool = False,
    fp8_weight_strategy: str = "channel",
    fp8_static_activations: bool = False,
    seed: int = 0,
) -> Path:
    """Quantize the float checkpoint ``src`` (single file or sharded) into ``dst`` in ``method``'s published format.

    - ``"awq"``: AutoAWQ GEMM, 4 bits; ``sym`` defaults to False (zero points); ``sym=True`` writes
      ``zero_point: false`` with every zero at the midpoint 8 (so GEMM loaders that read qzeros agree).
    - ``"gptq"``: checkpoint_format "gptq" (zero points stored minus one), 4 or 8 bits, ``sym`` defaults to True;
      ``desc_act`` draws one seeded random input permutation per layer input (q/k/v share one, gate/up share one,
      o and down each their own) and groups the inputs in that order, as GPTQ's act order does, with the
      matching ``g_idx``.
    - ``"fp8"``: compressed-tensors "float-quantized", per-``"channel"`` or per-``"tensor"`` float32 weight
      scales (max |w| / 448); ``fp8_static_activations`` writes one ``input_scale`` per layer: the largest |input|
      the float model sees on a seeded batch of 4 x 64 random tokens, divided by 448 (what a static min-max
      observer records, with random tokens standing in for calibration text).

    ``group_size`` -1 is one group per output channel; a group size that does not divide a layer's input features
    raises ValueError. Returns ``dst``.
    """
    opts = _options(method, bits, group_size, sym, desc_act, fp8_weight_strategy, fp8_static_activations, seed)
    src, dst = Path(src), Path(dst)
    hf_config = json.loads((src / "config.json").read_text())
    if hf_config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({hf_config['quantization_config'].get('quant_method')})")
    shards = _shard_names(src)
    input_scales = _calibrate_input_scales(src, seed) if opts.fp8_static_activations else {}
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in shards:
        written: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(src / shard).items():
            match = _TARGET.match(name)
            if match is None:
                written[name] = tensor
                continue
            for suffix, value in _quantize_module(tensor, match, opts, input_scales).items():
                written[f"{match['module']}.{suffix}"] = value
        save_file(written, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(written, shard))
        total_size += sum(t.numel() * t.element_size() for t in written.values())
    if (src / _INDEX).exists():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    hf_config["quantization_config"] = _quantization_config(opts)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.name not in ("config.json", _INDEX) and path.suffix != ".safetensors":
            shutil.copy2(path, dst / path.name)
    return dst


def _options(
    method: str,
    bits: int,
    group_size: int,
    sym: Optional[bool],
    desc_act: bool,
    strategy: str,
    static: bool,
    seed: int,
) -> _Options:
    if method == "awq":
        if bits != 4 or desc_act:
            raise ValueError(f"AWQ GEMM checkpoints are 4-bit without act order (got bits={bits}, desc_act={desc_act})")
        sym = False if sym is None else sym
    elif method == "gptq":
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints are written with 4 or 8 bits, got {bits}")
        sym = True if sym is None else sym
    elif method == "fp8":
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"fp8_weight_strategy must be 'channel' or 'tensor', got {strategy!r}")
        bits, sym = 8, True
    else:
        raise ValueError(f"cannot write a {method!r} checkpoint; choose awq, gptq or fp8 (int8 is quantized at load)")
    if group_size == 0 or group_size < -1:
        raise ValueError(f"group_size must be positive or -1 (one group per output channel), got {group_size}")
    return _Options(method, bits, group_size, sym, desc_act, strategy, static and method == "fp8", seed)


def _shard_names(src: Path) -> list[str]:
    if (src / _INDEX).exists():
        weight_map = json.loads((src / _INDEX).read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (src / "model.safetensors").exists():
        return ["model.safetensors"]
    raise ValueError(f"{src} has no model.safetensors or {_INDEX}")


def _quantize_module(
    weight: torch.Tensor, match: re.Match, opts: _Options, input_scales: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (suffix -> tensor) that replace ``<module>.weight``."""
    w = weight.detach().float()  # [out, in]
    if opts.method == "fp8":
        tensors = _quantize_fp8(w, opts.fp8_weight_strategy)
        if opts.fp8_static_activations:
            tensors["input_scale"] = input_scales[match["module"]]
        return tensors
    out_features, in_features = w.shape
    size = in_features if opts.group_size == -1 else opts.group_size
    if in_features % size != 0:
        raise ValueError(f"group size {opts.group_size} does not divide {match[0]}'s {in_features} input features")
    per_word = 32 // opts.bits
    if out_features % per_word != 0 or in_features % per_word != 0:
        raise ValueError(f"{match[0]} of shape {tuple(w.shape)} cannot be packed {per_word} values per int32")
    if opts.method == "awq":
        q, scales, zeros = _rtn_groups(w, size, opts.bits, "awq_sym" if opts.sym else "asym")
        return {"qweight": _pack_awq(q.t()), "qzeros": _pack_awq(zeros), "scales": scales}
    perm = None
    if opts.desc_act:
        role = match["attn"] or match["mlp"] or _MIXTRAL_ROLES[match["mixtral"]]
        generator = torch.Generator().manual_seed(opts.seed * 1_000_003 + int(match["layer"]) * 8 + _INPUT_GROUP[role])
        perm = torch.randperm(in_features, generator=generator)
        w = w[:, perm]  # GPTQ quantizes the inputs in act order: group g holds perm[g*size:(g+1)*size]
    q, scales, zeros = _rtn_groups(w, size, opts.bits, "sym" if opts.sym else "asym")
    g_idx = torch.arange(in_features, dtype=torch.int32) // size
    if perm is not None:  # back to the checkpoint's input order, each input remembering its group
        q_ordered, g_ordered = torch.empty_like(q), torch.empty_like(g_idx)
        q_ordered[:, perm], g_ordered[perm] = q, g_idx
        q, g_idx = q_ordered, g_ordered
    stored_zeros = (zeros - 1) & ((1 << opts.bits) - 1)  # checkpoint_format "gptq" stores zero - 1
    return {
        "qweight": _pack_along(q.t(), opts.bits, dim=0),
        "qzeros": _pack_along(stored_zeros, opts.bits, dim=1),
        "scales": scales,
        "g_idx": g_idx,
    }


def _fp16_at_least(values: torch.Tensor) -> torch.Tensor:
    """``values`` (positive float32) in fp16, rounded up where rounding to nearest would make them smaller."""
    half = values.clamp(min=2.0**-24).half()
    below = half.float() < values
    # For positive fp16 values, adding 1 to the bit pattern gives the next larger value.
    half = (half.view(torch.int16) + below.to(torch.int16)).view(torch.float16)
    if torch.isinf(half).any():
        raise ValueError("weights too large for fp16 quantization scales")
    return half


def _rtn_groups(w: torch.Tensor, size: int, bits: int, scheme: str) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest group quantization of ``w`` [out, in] (groups of ``size`` consecutive inputs).

    Returns q [out, in] int64 in [0, 2**bits), scales [G, out] fp16 and zeros [G, out] int64, such that
    ``w ~= (q - zeros) * scales``. Schemes: "asym" (min-max range with zero included, integer zero point),
    "sym" (GPTQ: scale = 2 max|w| / (2**bits - 1), zero at the midpoint), "awq_sym" (AWQ zero_point false:
    scale = max|w| / (2**(bits-1) - 1), signed values offset by the midpoint).
    """
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // size, size)  # [out, G, size]
    maxq, mid = (1 << bits) - 1, 1 << (bits - 1)
    if scheme == "asym":
        lo = groups.amin(dim=-1).clamp(max=0.0)  # [out, G]
        scales = _fp16_at_least((groups.amax(dim=-1).clamp(min=0.0) - lo) / maxq)
        zeros = torch.round(-lo / scales.float()).clamp(0, maxq)  # [out, G]
    else:
        amax = groups.abs().amax(dim=-1)
        scales = _fp16_at_least(amax * 2 / maxq if scheme == "sym" else amax / (mid - 1))
        zeros = torch.full_like(amax, float(mid))
    ratio = torch.round(groups / scales.float().unsqueeze(-1))  # [out, G, size]
    if scheme == "awq_sym":
        q = ratio.clamp(-mid, mid - 1) + mid
    else:
        q = (ratio + zeros.unsqueeze(-1)).clamp(0, maxq)
    return q.reshape(out_features, in_features).long(), scales.t().contiguous(), zeros.t().long().contiguous()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns -> int32 with the same bits (as the tools store them)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, out] 4-bit values -> [rows, out/8] int32: nibble i holds column 8c + AWQ_PACK_ORDER[i]."""
    rows, cols = values.shape
    eights = values.long().reshape(rows, cols // 8, 8)
    words = sum(eights[:, :, column] << (4 * nibble) for nibble, column in enumerate(AWQ_PACK_ORDER))
    return _to_int32(words).contiguous()


def _pack_along(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack ``32 // bits`` consecutive values along ``dim`` (0 or 1) of a 2-D tensor into one int32, lowest first."""
    per_word = 32 // bits
    moved = values.long().movedim(dim, -1)  # [other, n]
    slots = moved.reshape(moved.shape[0], -1, per_word)  # [other, n / per_word, per_word]
    words = sum(slots[:, :, j] << (bits * j) for j in range(per_word))
    return _to_int32(words).movedim(-1, dim).contiguous()


def _quantize_fp8(w: torch.Tensor, strategy: str) -> dict[str, torch.Tensor]:
    """compressed-tensors FP8: scale = max|w| / 448 per row ([out, 1]) or per tensor ([1]), float32."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_E4M3_MAX
    q = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": q.contiguous(), "weight_scale": scale.contiguous()}


def _calibrate_input_scales(src: Path, seed: int) -> dict[str, torch.Tensor]:
    """Static FP8 activation scales [1] float32 per target module: max |input| over a seeded random batch / 448."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    amax: dict[str, torch.Tensor] = {}

    def recorder(name: str):
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            seen = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen

        return hook

    hooks = [
        module.register_forward_pre_hook(recorder(name))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and _TARGET.match(f"{name}.weight")
    ]
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=generator)
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    return {name: (value.clamp(min=1e-12) / FP8_E4M3_MAX).reshape(1) for name, value in amax.items()}


def _quantization_config(opts: _Options) -> dict:
    """config.json's quantization_config, with the keys the real tools write."""
    if opts.method == "awq":  # AutoAWQ
        return {
            "quant_method": "awq",
            "bits": opts.bits,
            "group_size": opts.group_size,
            "zero_point": not opts.sym,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if opts.method == "gptq":  # GPTQModel
        return {
            "bits": opts.bits,
            "group_size": opts.group_size,
            "desc_act": opts.desc_act,
            "sym": opts.sym,
            "lm_head": False,
            "quant_method": "gptq",
            "checkpoint_format": "gptq",
            "pack_dtype": "int32",
            "static_groups": False,
            "true_sequential": True,
            "damp_percent": 0.01,
            "damp_auto_increment": 0.0025,
            "meta": {"quantizer": ["pagoda.testing.quant_writers (round to nearest)"]},
        }
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "dynamic": False}
    if opts.fp8_static_activations:
        activations = {**fp8, "strategy": "tensor", "observer": "static_minmax"}
    else:
        activations = {**fp8, "strategy": "token", "dynamic": True}
    return {  # compressed-tensors (llm-compressor), as QuantizationConfig serialises itself
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": opts.fp8_weight_strategy, "observer": "minmax"},
                "input_activations": activations,
                "output_activations": None,
                "format": None,
            }
        },
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "version": "0.20.1",
    }
