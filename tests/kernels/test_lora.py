"""Batched multi-LoRA shrink/expand kernels against their torch references, and the references against a naive
per-token formula.

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes are small
but still span several row, column and K tiles (the interpreter uses 16-row, 16-column, 32-deep tiles). Weights
of slots no segment uses, and ``shrunk`` rows of tokens in no segment, are NaN: reading them shows up. bf16
tolerances are loose because the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest.
"""

from __future__ import annotations

import pytest
import torch

from pagoda_kernels.lora import (
    lora_expand,
    lora_expand_reference,
    lora_segments,
    lora_shrink,
    lora_shrink_reference,
)

SHRINK_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-3, atol=1e-3)}
EXPAND_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
QKV, GATE_UP, DOWN = (64, 32, 32), (48, 48), (40,)
# Segment lengths per slot of a 4-slot layer: empty (slot 1), 1, 5 and 13 tokens, plus 7 base-model tokens.
RAGGED = {0: 13, 1: 0, 2: 1, 3: 5}

# Outputs come from torch.empty or torch.zeros: poison empty (tests/kernels/conftest.py) so a switch shows up.
pytestmark = pytest.mark.usefixtures("poisoned_allocations")


def _token_slots(lengths: dict[int, int], num_base: int, seed: int = 0) -> torch.Tensor:
    """[num_tokens] int64 slots with adapters' tokens and base tokens (-1) interleaved at random."""
    slots = [s for s, n in lengths.items() for _ in range(n)] + [-1] * num_base
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(seed))
    return torch.tensor(slots, dtype=torch.long)[order]


def _layer(
    token_slots: torch.Tensor,
    in_features: int,
    output_slices: tuple[int, ...],
    max_rank: int,
    max_loras: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, in], lora_a [L, S * R, in], lora_b [L, out, R]); slots no token uses hold NaN weights."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, out_features = token_slots.shape[0], sum(output_slices)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a = torch.randn(max_loras, len(output_slices) * max_rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(max_loras, out_features, max_rank, generator=gen) / max_rank**0.5
    unused = [s for s in range(max_loras) if not (token_slots == s).any()]
    a[unused], b[unused] = float("nan"), float("nan")
    return x, a.to(dtype), b.to(dtype)


def _shrunk_with_nan_base_rows(shrunk: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    shrunk = shrunk.clone()
    shrunk[token_slots < 0] = float("nan")  # expand must not read rows of tokens in no segment
    return shrunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_rank", [8, 16, 64])
@pytest.mark.parametrize(("in_features", "output_slices"), [(72, QKV), (96, GATE_UP), (64, DOWN)])
def test_shrink_matches_reference(
    in_features: int, output_slices: tuple[int, ...], max_rank: int, dtype: torch.dtype
) -> None:
    token_slots = _token_slots(RAGGED, num_base=7, seed=max_rank)
    x, a, _ = _layer(token_slots, in_features, output_slices, max_rank, 4, dtype)
    mapping = lora_segments(token_slots, 4)
    shrunk = lora_shrink(x, a, *mapping)
    assert shrunk.shape == (x.shape[0], len(output_slices) * max_rank) and shrunk.dtype == torch.float32
    torch.testing.assert_close(shrunk, lora_shrink_reference(x, a, *mapping), **SHRINK_TOL[dtype])
    assert torch.equal(shrunk[token_slots < 0], torch.zeros_like(shrunk[token_slots < 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_rank", [8, 16, 64])
@pytest.mark.parametrize(("in_features", "output_slices"), [(72, QKV), (96, GATE_UP), (64, DOWN)])
def test_expand_matches_reference(
    in_features: int, output_slices: tuple[int, ...], max_rank: int, dtype: torch.dtype
) -> None:
    token_slots = _token_slots(RAGGED, num_base=7, seed=max_rank)
    x, a, b = _layer(token_slots, in_features, output_slices, max_rank, 4, dtype)
    mapping = lora_segments(token_slots, 4)
    shrunk = _shrunk_with_nan_base_rows(lora_shrink_reference(x, a, *mapping), token_slots)
    out = torch.randn(x.shape[0], sum(output_slices)).to(dtype)
    expected, before = out.clone(), out.clone()
    lora_expand(out, shrunk, b, output_slices, *mapping)
    lora_expand_reference(expected, shrunk, b, output_slices, *mapping)
    torch.testing.assert_close(out, expected, **EXPAND_TOL[dtype])
    assert torch.equal(out[token_slots < 0], before[token_slots < 0])


def _naive(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, output_slices: tuple[int, ...], token_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ A_slot^T, delta) per token and slice in float64, straight from token_slots (no mapping)."""
    rank = b.shape[2]
    shrunk = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        shrunk[t] = x[t].double() @ a[slot].double().T
        off = 0
        for s, size in enumerate(output_slices):
            a_s = a[slot, s * rank : (s + 1) * rank].double()  # [rank, in_features]
            delta[t, off : off + size] = (x[t].double() @ a_s.T) @ b[slot, off : off + size].double().T
            off += size
    return shrunk, delta


@pytest.mark.parametrize(("max_rank", "output_slices"), [(8, QKV), (16, GATE_UP), (64, DOWN)])
def test_references_match_naive_per_token_formula(max_rank: int, output_slices: tuple[int, ...]) -> None:
    token_slots = _token_slots(RAGGED, num_base=7, seed=3)
    x, a, b = _layer(token_slots, 72, output_slices, max_rank, 4, torch.float32)
    mapping = lora_segments(token_slots, 4)
    naive_shrunk, naive_delta = _naive(x, a, b, output_slices, token_slots)
    shrunk = lora_shrink_reference(x, a, *mapping)
    torch.testing.assert_close(shrunk.double(), naive_shrunk, rtol=1e-5, atol=1e-5)
    out = torch.randn(x.shape[0], sum(output_slices))
    expected = out.double() + naive_delta
    lora_expand_reference(out, shrunk, b, output_slices, *mapping)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_long_segments_and_a_300_token_batch() -> None:
    # 37 and 120 tokens span several 16-row tiles; 300 tokens is the largest batch the kernels are sized for.
    token_slots = _token_slots({0: 120, 1: 37, 2: 100}, num_base=43, seed=5)
    x, a, b = _layer(token_slots, 80, GATE_UP, 16, 3, torch.float32)
    mapping = lora_segments(token_slots, 3)
    shrunk = lora_shrink(x, a, *mapping)
    torch.testing.assert_close(shrunk, lora_shrink_reference(x, a, *mapping), **SHRINK_TOL[torch.float32])
    out = torch.randn(300, sum(GATE_UP))
    expected = out.clone()
    lora_expand(out, shrunk, b, GATE_UP, *mapping)
    lora_expand_reference(expected, shrunk, b, GATE_UP, *mapping)
    torch.testing.assert_close(out, expected, **EXPAND_TOL[torch.float32])


def test_single_token_batch() -> None:
    token_slots = torch.tensor([2])
    x, a, b = _layer(token_slots, 72, QKV, 8, 3, torch.float32)
    mapping = lora_segments(token_slots, 3)
    shrunk = lora_shrink(x, a, *mapping)
    out = torch.zeros(1, sum(QKV))
    lora_expand(out, shrunk, b, QKV, *mapping)
    _, naive_delta = _naive(x, a, b, QKV, token_slots)
    torch.testing.assert_close(out.double(), naive_delta, rtol=1e-5, atol=1e-5)


def test_expand_into_strided_out_view_leaves_other_columns() -> None:
    token_slots = _token_slots(RAGGED, num_base=7, seed=1)
    x, a, b = _layer(token_slots, 72, QKV, 16, 4, torch.float32)
    mapping = lora_segments(token_slots, 4)
    shrunk = lora_shrink(x, a, *mapping)
    wide = torch.randn(x.shape[0], 8 + sum(QKV) + 24)
    before = wide.clone()
    out = wide[:, 8 : 8 + sum(QKV)]  # [T, 128], row stride 160
    expected = out.clone()
    lora_expand(out, shrunk, b, QKV, *mapping)
    lora_expand_reference(expected, shrunk, b, QKV, *mapping)
    torch.testing.assert_close(out, expected, **EXPAND_TOL[torch.float32])
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 8 + sum(QKV) :], before[:, 8 + sum(QKV) :])


def test_mapping_need_not_be_canonical() -> None:
    # Segments in any slot order, unused (-1) segments anywhere, a -1 segment covering tokens (left alone),
    # and trailing token ids no segment covers.
    _, a, b = _layer(torch.tensor([0, 2]), 64, GATE_UP, 8, 3, torch.float32)  # slot 1's weights are NaN
    x = torch.randn(9, 64)
    sorted_token_ids = torch.tensor([4, 0, 7, 1, 3, 8, 2, 5, 6], dtype=torch.int32)
    segment_starts = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # slot 2: tokens 4, 0, 7; none; 1, 3
    segment_slots = torch.tensor([2, -1, -1], dtype=torch.int32)
    mapping = (sorted_token_ids, segment_starts, segment_slots)
    shrunk = lora_shrink(x, a, *mapping)
    torch.testing.assert_close(shrunk, lora_shrink_reference(x, a, *mapping), **SHRINK_TOL[torch.float32])
    assert torch.equal(shrunk[[1, 2, 3, 5, 6, 8]], torch.zeros(6, shrunk.shape[1]))
    out = torch.randn(9, sum(GATE_UP))
    expected = out.clone()
    lora_expand(out, shrunk, b, GATE_UP, *mapping)
    lora_expand_reference(expected, shrunk, b, GATE_UP, *mapping)
    torch.testing.assert_close(out, expected, **EXPAND_TOL[torch.float32])


@pytest.mark.parametrize("num_tokens", [0, 5])
def test_all_base_batch_is_a_no_op(num_tokens: int) -> None:
    token_slots = torch.full((num_tokens,), -1)
    x, a, b = _layer(token_slots, 64, DOWN, 8, 3, torch.float32)  # every slot unused: all weights NaN
    mapping = lora_segments(token_slots, 3)
    shrunk = lora_shrink(x, a, *mapping)
    assert torch.equal(shrunk, torch.zeros(num_tokens, 8))
    out = torch.randn(num_tokens, 40)
    before = out.clone()
    lora_expand(out, torch.full_like(shrunk, float("nan")), b, DOWN, *mapping)
    assert torch.equal(out, before)


def test_lora_segments_orders_tokens_and_segments() -> None:
    ids, starts, slots = lora_segments(torch.tensor([2, -1, 0, 2, 0, -1, 2]), 4)
    assert ids.dtype == starts.dtype == slots.dtype == torch.int32
    assert ids.tolist() == [2, 4, 0, 3, 6, 1, 5]  # slot 0's tokens, slot 2's in order, then base tokens
    assert starts.tolist() == [0, 2, 5, 5, 5]
    assert slots.tolist() == [0, 2, -1, -1]


def test_lora_segments_empty_and_all_base() -> None:
    ids, starts, slots = lora_segments(torch.zeros(0, dtype=torch.int32), 3)
    assert ids.tolist() == [] and starts.tolist() == [0, 0, 0, 0] and slots.tolist() == [-1, -1, -1]
    ids, starts, slots = lora_segments(torch.full((4,), -1), 2)
    assert ids.tolist() == [0, 1, 2, 3] and starts.tolist() == [0, 0, 0] and slots.tolist() == [-1, -1]


@pytest.mark.parametrize(
    ("token_slots", "max_loras"),
    [(torch.tensor([0, 3]), 3), (torch.tensor([-2]), 3), (torch.zeros(2, 2, dtype=torch.long), 3), (torch.ones(2), 3)],
)
def test_lora_segments_rejects_bad_slots(token_slots: torch.Tensor, max_loras: int) -> None:
    with pytest.raises(ValueError):
        lora_segments(token_slots, max_loras)


def _bad_shrink_calls() -> dict[str, tuple]:
    x, a, _ = _layer(torch.tensor([0, 1, -1]), 64, QKV, 8, 2, torch.float32)
    ids, starts, slots = lora_segments(torch.tensor([0, 1, -1]), 2)
    return {
        "in_features": (x[:, :48], a, ids, starts, slots),
        "x_rank": (x[0], a, ids, starts, slots),
        "dtype": (x.half(), a, ids, starts, slots),
        "token_ids_len": (x, a, ids[:2], starts, slots),
        "token_ids_dtype": (x, a, ids.long(), starts, slots),
        "starts_len": (x, a, ids, starts[:2], slots),
        "slots_len": (x, a, ids, starts, torch.tensor([0, 1, -1], dtype=torch.int32)),
    }


@pytest.mark.parametrize("case", list(_bad_shrink_calls()))
def test_shrink_validates_arguments(case: str) -> None:
    args = _bad_shrink_calls()[case]
    for fn in (lora_shrink, lora_shrink_reference):
        with pytest.raises(ValueError):
            fn(*args)


def _bad_expand_calls() -> dict[str, tuple]:
    token_slots = torch.tensor([0, 1, -1])
    _, _, b = _layer(token_slots, 64, QKV, 8, 2, torch.float32)
    mapping = lora_segments(token_slots, 2)
    out, shrunk = torch.zeros(3, 128), torch.zeros(3, 24)
    return {
        "slices_sum": (out, shrunk, b, (64, 32, 16), *mapping),
        "slice_count": (out, shrunk, b, (64, 64), *mapping),
        "zero_slice": (out, shrunk, b, (64, 64, 0), *mapping),
        "shrunk_dtype": (out, shrunk.double(), b, QKV, *mapping),
        "shrunk_rows": (out, shrunk[:2], b, QKV, *mapping),
        "b_dtype": (out, shrunk, b.half(), QKV, *mapping),
        "out_features": (torch.zeros(3, 96), shrunk, b, QKV, *mapping),
        "out_column_stride": (torch.zeros(128, 3).T, shrunk, b, QKV, *mapping),
        "slots_dtype": (out, shrunk, b, QKV, mapping[0], mapping[1], mapping[2].long()),
    }


@pytest.mark.parametrize("case", list(_bad_expand_calls()))
def test_expand_validates_arguments(case: str) -> None:
    args = _bad_expand_calls()[case]
    for fn in (lora_expand, lora_expand_reference):
        with pytest.raises(ValueError):
            fn(*args)
