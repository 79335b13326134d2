"""Build a model from a Hugging Face directory and fill it from safetensors files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from pagoda.attention.protocol import AttentionBackend
from pagoda.config import check_quantization_tensor_parallel
from pagoda.confined_paths import confined_path
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.layers.linear import Linear, MergedLinear, linear_weights_on_meta, materialize_linear_weights
from pagoda.model_config import ModelConfig
from pagoda.models.registry import get_model_class
from pagoda.models.weights import FUSED_MODULES
from pagoda.quantization.config import QuantConfig
from pagoda.quantization.formats import QUANT_TENSOR_SUFFIXES, is_quantized_module
from pagoda.quantization.loading import (
    KV_SCALE_SUFFIXES,
    QuantizedLoad,
    QuantizedSource,
    apply_kv_scales,
    checkpoint_tensor_names,
    quant_config_for,
)

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def safetensors_files(model_dir: Union[str, Path]) -> list[Path]:
    """The weight files of a checkpoint: the shards named by the index, or the single file."""
    path = Path(model_dir)
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the shard index {str(index)!r}: {exc}") from exc
        try:  # the names come from the checkpoint (a Hub repo, an S3 prefix): each must be a file of this folder
            files = [confined_path(path, name, resolve=False) for name in sorted(set(map(str, weight_map.values())))]
        except ValueError as exc:
            raise ValueError(f"{_INDEX_FILE} in {str(path)!r} names a shard outside the checkpoint: {exc}") from None
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"shard(s) listed in {_INDEX_FILE} are missing from {str(path)!r}: {', '.join(absent)}")
        return files
    if (path / _SINGLE_FILE).is_file():
        return [path / _SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no safetensors weights found in {str(path)!r} (expected {_SINGLE_FILE} or {_INDEX_FILE}); "
            "PyTorch .bin checkpoints are not supported"
        )
    return files


def iterate_safetensors(
    model_dir: Union[str, Path],
    device: Union[str, torch.device] = "cpu",
    read: Optional[Callable[[str, Any], torch.Tensor]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one shard open at a time.

    ``read(name, lazy_slice)`` picks the part of each tensor to read (a tensor-parallel rank's shard): only those
    bytes are read from the file. A progress bar is shown only for sharded checkpoints.
    """
    files = safetensors_files(model_dir)
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                yield name, f.get_tensor(name) if read is None else read(name, f.get_slice(name))


def load_model(
    model_dir: Union[str, Path],
    attn_backend: AttentionBackend,
    dtype: torch.dtype,
    device: Union[str, torch.device] = "cpu",
    config: Optional[ModelConfig] = None,
    tp: TensorParallel = SINGLE,
    quantization: Optional[str] = None,
) -> nn.Module:
    """Instantiate the checkpoint's architecture on ``device`` in ``dtype`` and load its weights (under tensor
    parallelism, this rank's shard of them).

    ``quantization`` is ``--quantization`` (None: the checkpoint's own); layers of a quantized checkpoint keep their
    quantized tensors for :func:`~pagoda.layers.linear_kernels.prepare_linear_layers` (see
    :mod:`pagoda.quantization.loading`), and ``model.quant_config`` says what was resolved.

    ``config`` may be passed when the caller already parsed it; otherwise it is read from the directory.
    """
    config = config if config is not None else ModelConfig.from_model_dir(model_dir)
    quant = quant_config_for(model_dir, quantization)
    if quant is not None:  # the engine checked the flag; only the checkpoint says whether its tensors are quantized
        check_quantization_tensor_parallel(quant.method, tp.world_size, quant.serialized)
    model_cls = get_model_class(config.architecture)
    serialized = quant is not None and quant.serialized
    with torch.device(device), linear_weights_on_meta() if serialized else contextlib.nullcontext():
        model = model_cls(config, attn_backend, dtype, tp=tp)
    model.quant_config = quant  # how prepare_linear_layers turns the weights into kernels
    router = None
    if serialized:
        router = attach_quantized_sources(model, quant, checkpoint_tensor_names(safetensors_files(model_dir)))
        materialize_linear_weights(model, device)  # the layers the checkpoint left unquantized (the lm_head)
    read = model.read_shard if tp.world_size > 1 else None
    kv_scales: dict[str, torch.Tensor] = {}

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iterate_safetensors(model_dir, device, read):
            if name.endswith(KV_SCALE_SUFFIXES):
                kv_scales[name] = tensor
            elif router is None or not router.take(name, tensor):  # quantized tensors are kept as stored
                # Cast on the device the tensor was loaded to, so a GPU load never holds an fp32 copy on the host.
                # Integer tensors (gpt-oss's MXFP4 blocks and scales) stay as stored: the model class reads them.
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor

    model.load_weights(weights())
    apply_kv_scales(model, kv_scales)
    return model.eval()


def attach_quantized_sources(model: nn.Module, config: QuantConfig, names: set[str]) -> QuantizedLoad:
    """Give every layer the checkpoint quantizes a :class:`~pagoda.quantization.loading.QuantizedSource` in place of
    its dense weight (:meth:`~pagoda.layers.linear.Linear.hold_quantized_source`); return the router for the
    checkpoint's tensors. ``names``: every tensor name of the checkpoint."""
    assert config.serialized, config
    sources: list[QuantizedSource] = []
    for module_name, layer in model.named_modules():
        if not isinstance(layer, Linear) or layer.weight is None:
            continue
        hf_modules = _hf_modules(module_name, layer)
        # a family whose checkpoints name modules otherwise (Mixtral's block_sparse_moe.experts.{e}.w1) maps them
        rename = getattr(model, "checkpoint_module_name", None)
        hf_modules = tuple(map(rename, hf_modules)) if rename is not None else hf_modules
        quantized = [is_quantized_module(config.method, names, hf) for hf in hf_modules]
        if not any(quantized):
            continue
        if not all(quantized):
            raise ValueError(
                f"checkpoint quantizes only some of {', '.join(hf_modules)}, which Pagoda runs as one fused "
                "projection; quantize all of them or none"
            )
        if _is_tied(model, layer):
            raise ValueError(f"{module_name} shares the embedding's weight and cannot be quantized separately")
        source = QuantizedSource(config, hf_modules)
        layer.hold_quantized_source(source)
        sources.append(source)
    if not sources:
        raise ValueError(
            f"config.json says the checkpoint is {config.method}-quantized, but no layer has quantized tensors "
            f"({', '.join(QUANT_TENSOR_SUFFIXES[config.method])})"
        )
    return QuantizedLoad(config, sources)


def _hf_modules(module_name: str, layer: Linear) -> tuple[str, ...]:
    """The checkpoint module(s) that fill ``module_name``: one per part of a fused projection."""
    prefix, _, leaf = module_name.rpartition(".")
    if isinstance(layer, MergedLinear) and leaf in FUSED_MODULES:
        return tuple(f"{prefix}.{part}" if prefix else part for part in FUSED_MODULES[leaf])
    return (module_name,)


def _is_tied(model: nn.Module, layer: Linear) -> bool:
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embed is not None and layer.weight is embed.weight
