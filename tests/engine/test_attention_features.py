"""Attention features of the newer model families through ``pagoda.layers.Attention`` and the torch backend.

A layer's softmax scale (Gemma's ``query_pre_attn_scalar``), its logit soft cap (Gemma 2: ``cap * tanh(s / cap)``
before the mask) and its attention sinks (gpt-oss: one learned logit per query head, an extra softmax column whose
probability is dropped) must give, over a paged cache filled by chunked prefill, mixed prefill + decode steps and
decodes, exactly what a dense attention over the whole sequence gives. The dense reference below follows
transformers' eager attention of gemma2 / gpt_oss step by step.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from pagoda.attention.protocol import AttentionLayerSpec, build_metadata, dequantize_kv, quantize_kv
from pagoda.attention.torch_backend import TorchAttentionBackend, native_attention_applies
from pagoda.layers import Attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
# Two requests: A is prefilled in chunks of 6 and 5 tokens (the second on a cached prefix), then decodes; B's
# 7-token prompt is prefilled in A's first step, and B decodes while A's second chunk runs (a mixed step).
LENGTHS = {"A": 13, "B": 10}
STEPS = [{"A": 6, "B": 7}, {"A": 5, "B": 1}, {"A": 1, "B": 1}, {"A": 1, "B": 1}]


def dense_reference(
    q: torch.Tensor,  # [seq, heads, dim]
    k: torch.Tensor,  # [seq, kv_heads, dim]
    v: torch.Tensor,
    scale: float,
    soft_cap: Optional[float] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # [seq, heads, dim]
    """Causal attention over one whole sequence in float32, as transformers' eager paths compute it."""
    group = q.shape[1] // k.shape[1]
    query = q.float().transpose(0, 1)  # [heads, seq, dim]
    key = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    value = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    weights = torch.matmul(query, key.transpose(1, 2)) * scale
    if soft_cap is not None:
        weights = torch.tanh(weights / soft_cap) * soft_cap
    pos = torch.arange(q.shape[0])
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    weights = weights + torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        logits = torch.cat([weights, sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        weights = F.softmax(logits, dim=-1)[..., :-1]
    else:
        weights = F.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(0, 1)


def run_layer(layer: Attention, q, k, v, cache_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Feed each request's q/k/v through the layer step by step (STEPS); returns each request's outputs in order."""
    tables = {"A": [9, 2, 7, 0], "B": [4, 8, 1]}  # scattered blocks, distinct per request
    kv_cache = torch.zeros(2, 10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=cache_dtype)
    done = {name: 0 for name in LENGTHS}
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in LENGTHS}
    for step in STEPS:
        names = list(step)
        spans = {n: slice(done[n], done[n] + step[n]) for n in names}
        meta = build_metadata(
            [step[n] for n in names], [spans[n].stop for n in names], [tables[n] for n in names], BLOCK_SIZE
        )
        layer.backend.prepare(meta)
        out = layer(*(torch.cat([t[n][spans[n]] for n in names]) for t in (q, k, v)), kv_cache, meta)
        for i, n in enumerate(names):
            outputs[n].append(out[meta.query_start_loc[i] : meta.query_start_loc[i + 1]])
            done[n] = spans[n].stop
    assert done == LENGTHS
    return {n: torch.cat(outputs[n]) for n in LENGTHS}


def random_sequences(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def make(heads: int) -> dict[str, torch.Tensor]:
        return {n: (torch.randn(length, heads, HEAD_DIM, generator=gen) * 2).to(dtype) for n, length in LENGTHS.items()}

    return make(NUM_HEADS), make(NUM_KV_HEADS), make(NUM_KV_HEADS)


FEATURES = {
    "scale": dict(scale=0.125),
    "soft_cap": dict(logits_soft_cap=3.0),
    "soft_cap+window": dict(logits_soft_cap=3.0, sliding_window=5, scale=0.2),
    "sinks": dict(sinks=True),
    "sinks+window": dict(sinks=True, sliding_window=5),
    "all": dict(sinks=True, logits_soft_cap=2.5, sliding_window=6, scale=0.3),
}


def make_layer(features: dict) -> Attention:
    features = dict(features)
    window = features.pop("sliding_window", None)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TorchAttentionBackend(), window, **features)
    if layer.sinks is not None:
        layer.sinks.data = torch.tensor([1.5, -0.5, 3.0, 0.0])  # a strong sink on head 2, none to speak of on 1
    return layer


@pytest.mark.parametrize("cache", ["model", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_paged_steps_equal_dense_attention(name, dtype, cache):
    layer = make_layer(FEATURES[name])
    q, k, v = random_sequences(dtype)
    cache_dtype = torch.float8_e4m3fn if cache == "fp8_e4m3" else dtype
    if cache == "fp8_e4m3":
        layer.set_kv_scales(0.05, 0.03)
    outputs = run_layer(layer, q, k, v, cache_dtype)
    spec = layer.spec
    for n in LENGTHS:
        keys, values = k[n], v[n]
        if cache == "fp8_e4m3":  # what every reader of the cache sees
            keys = dequantize_kv(quantize_kv(keys, spec.k_scale, cache_dtype), spec.k_scale, dtype)
            values = dequantize_kv(quantize_kv(values, spec.v_scale, cache_dtype), spec.v_scale, dtype)
        want = dense_reference(q[n], keys, values, spec.scale, spec.logits_soft_cap, spec.sliding_window, layer.sinks)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outputs[n].float(), want, rtol=tol, atol=tol)


def test_the_plain_path_gives_the_same_result_in_parts(monkeypatch):
    """A bound on the scores held at once (decode batches over long contexts, long prompt chunks) slices the batch
    and the query rows; the result does not change."""
    import pagoda.attention.torch_backend as torch_backend

    layer = make_layer(FEATURES["all"])
    q, k, v = random_sequences(torch.float32)
    whole = run_layer(layer, q, k, v, torch.float32)
    monkeypatch.setattr(torch_backend, "_PLAIN_SCORES", 64)  # below one row's scores: one row per pass
    parts = run_layer(layer, q, k, v, torch.float32)
    for n in LENGTHS:
        torch.testing.assert_close(parts[n], whole[n], rtol=1e-6, atol=1e-6)


def test_each_feature_changes_the_result():
    q, k, v = random_sequences(torch.float32)
    plain = run_layer(make_layer({}), q, k, v, torch.float32)["A"]
    for features in (dict(scale=0.125), dict(logits_soft_cap=3.0), dict(sinks=True)):
        assert not torch.allclose(run_layer(make_layer(features), q, k, v, torch.float32)["A"], plain, atol=1e-3)


def test_a_dominant_sink_takes_the_probability_and_soft_cap_bounds_the_scores():
    q, k, v = random_sequences(torch.float32)
    layer = make_layer(dict(sinks=True))
    layer.sinks.data = torch.tensor([60.0, 60.0, 60.0, 60.0])  # e^60 outweighs every key: outputs ~ 0
    assert run_layer(layer, q, k, v, torch.float32)["A"].abs().max() < 1e-6
    # Queries 1000x larger: without a cap one key takes everything; capped at 1, scores stay within [-1, 1] and
    # no key gets more than e^2 times another's weight.
    capped = make_layer(dict(logits_soft_cap=1.0))
    out = run_layer(capped, {n: t * 1000 for n, t in q.items()}, k, v, torch.float32)
    want = dense_reference(q["B"] * 1000, k["B"], v["B"], capped.spec.scale, soft_cap=1.0)
    torch.testing.assert_close(out["B"], want, rtol=1e-5, atol=1e-5)


def test_the_default_layer_is_unchanged():
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TorchAttentionBackend(), 5)
    assert layer.spec == AttentionLayerSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, 5)
    assert layer.sinks is None and list(layer.parameters()) == []
    assert layer.spec.plain_softmax
    # bf16 layers keep the native CPU kernel where it is built; soft-capped or sink layers leave it
    probe = torch.empty(1, NUM_HEADS, 32, dtype=torch.bfloat16)
    spec = AttentionLayerSpec(NUM_HEADS, NUM_KV_HEADS, 32, 32**-0.5)
    native = native_attention_applies(probe, spec)
    assert native == native_attention_applies(probe, AttentionLayerSpec(NUM_HEADS, NUM_KV_HEADS, 32, 0.1))
    for extra in (dict(logits_soft_cap=30.0), dict(has_sinks=True)):
        assert not native_attention_applies(probe, AttentionLayerSpec(NUM_HEADS, NUM_KV_HEADS, 32, 0.1, **extra))
    # A float32 layer: the prefill is exactly SDPA over the prompt
    q, k, v = random_sequences(torch.float32)
    out = run_layer(make_layer({}), q, k, v, torch.float32)["B"][:7]
    q_b, k_b, v_b = (t["B"][None, :7].transpose(1, 2) for t in (q, k, v))
    want = F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True, enable_gqa=True).transpose(1, 2)[0]
    assert torch.equal(out, want)


def test_sinks_are_a_float32_parameter_per_query_head_and_must_be_passed():
    layer = Attention(8, 2, HEAD_DIM, TorchAttentionBackend(), sinks=True)
    assert layer.sinks.dtype == torch.float32 and layer.sinks.shape == (8,)
    assert dict(layer.named_parameters()).keys() == {"sinks"}
    assert layer.spec.has_sinks and not layer.spec.plain_softmax
    meta = build_metadata([2], [2], [[0]], BLOCK_SIZE)
    cache = torch.zeros(2, 1, BLOCK_SIZE, 2, HEAD_DIM)
    q, kv = torch.randn(2, 8, HEAD_DIM), torch.randn(2, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="sinks"):
        layer.backend.forward(q, kv, kv, cache, meta, layer.spec)
    with pytest.raises(ValueError, match="sinks"):
        layer.backend.forward(q, kv, kv, cache, meta, layer.spec, sinks=torch.zeros(4))


@pytest.mark.parametrize("bad", [dict(scale=0.0), dict(scale=math.inf), dict(logits_soft_cap=-1.0)])
def test_bad_scale_or_cap_is_refused(bad):
    with pytest.raises(ValueError):
        Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TorchAttentionBackend(), **bad)


@pytest.mark.parametrize(
    "query_lens, seq_lens", [([6, 1, 5], [19, 11, 5]), ([1, 1, 1], [17, 3, 9])], ids=["mixed", "decode"]
)
def test_the_triton_backend_gives_what_the_torch_backend_gives(query_lens, seq_lens):
    from pagoda.attention.triton_backend import TritonAttentionBackend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # without a GPU: Triton's interpreter
    spec = AttentionLayerSpec(4, 2, 16, 0.3, 6, logits_soft_cap=2.0, has_sinks=True)
    sinks = torch.tensor([0.5, 2.0, -1.0, 0.0], device=device)
    gen = torch.Generator().manual_seed(3)
    tables = [[5, 0, 3, 9, 1], [2, 7, 11], [4, 6, 8]]
    q, k, v = (torch.randn(sum(query_lens), h, 16, generator=gen).to(device) for h in (4, 2, 2))
    kv_cache = torch.randn(2, 12, BLOCK_SIZE, 2, 16, generator=gen).to(device)  # stands in for cached prefixes
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        meta = build_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        meta.block_tables, meta.slot_mapping = meta.block_tables.to(device), meta.slot_mapping.to(device)
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, kv_cache.clone(), meta, spec, sinks=sinks))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
