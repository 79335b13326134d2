"""Every kernel of a LoRA-wrapped layer adds the same delta, the naive per-slice formula's: the native CPU op, the
PyTorch fallback (block-diagonal GEMMs per segment), and the Triton shrink/expand kernels over the device mapping
that CUDA uses (run here in Triton's interpreter). Ragged segments, base-model rows, ranks 8/16/64, the fused
q/k/v and gate/up slices."""

import pytest
import torch

from pagoda.lora.layers import LinearLoRA, LoRAContext, LoRASegments
from pagoda.lora.slots import device_mapping

IN, MAX_LORAS = 48, 3
LAYOUTS = {"qkv": (64, 32, 32), "gate_up": (40, 40), "down": (24,)}
# (slot, first row, end row): rows 0-2 are the base model's; segments of 2, 7 and 1 rows
RUNS = [(2, 3, 5), (0, 5, 12), (1, 12, 13)]
NUM_ROWS = 13


def adapter_parts(slices, rank: int, seed: int, only=None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    parts = {
        i: (torch.randn(rank, IN, generator=gen), torch.randn(n, rank, generator=gen)) for i, n in enumerate(slices)
    }
    return {i: p for i, p in parts.items() if only is None or i in only}


def naive(x, slices, parts, runs):
    delta = torch.zeros(x.shape[0], sum(slices))
    for slot, start, end in runs:
        offset = 0
        for part, n in enumerate(slices):
            if part in parts[slot]:
                a, b = parts[slot][part]
                delta[start:end, offset : offset + n] = x[start:end] @ a.T @ b.T
            offset += n
    return delta


MODES = [("native", torch.float32), ("native", torch.bfloat16), ("torch", torch.float32), ("triton", torch.float32)]


@pytest.mark.parametrize(("mode", "dtype"), MODES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("max_rank", [8, 16, 64])
def test_each_segment_gets_its_slots_delta_and_base_rows_nothing(mode, dtype, layout, max_rank) -> None:
    slices = LAYOUTS[layout]
    context = LoRAContext()
    layer = LinearLoRA(context, IN, slices, MAX_LORAS, max_rank, dtype, torch.device("cpu"), mode)
    # slot 0: the full rank; slot 1: only the second slice (if any); slot 2: a smaller rank
    parts = {
        0: adapter_parts(slices, max_rank, 0),
        1: adapter_parts(slices, max_rank // 2, 1, only={len(slices) - 1}),
        2: adapter_parts(slices, 4, 2),
    }
    for slot, slot_parts in parts.items():
        layer.set_slot(slot, slot_parts)
    segments = LoRASegments(NUM_ROWS, RUNS)
    if mode == "triton":
        segments.device_mapping = device_mapping(RUNS, NUM_ROWS, MAX_LORAS, torch.device("cpu"))
    context.full = segments
    x = torch.randn(NUM_ROWS, IN, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = torch.ones(NUM_ROWS, sum(slices), dtype=dtype)
    layer.add_to(out, x)
    rounded = {
        s: {p: (a.to(dtype).float(), b.to(dtype).float()) for p, (a, b) in pp.items()} for s, pp in parts.items()
    }
    expected = (1 + naive(x.float(), slices, rounded, RUNS)).to(dtype)
    # bf16: the delta (up to ~60 in size) is added in float32 and rounded once; the reference rounds the same sum
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 0.5}
    torch.testing.assert_close(out, expected, **tolerance)
    assert torch.equal(out[:3], torch.ones(3, sum(slices), dtype=dtype))


def test_a_cleared_slot_adds_nothing_and_a_layer_without_adapter_rows_is_inactive() -> None:
    context = LoRAContext()
    layer = LinearLoRA(context, IN, LAYOUTS["down"], MAX_LORAS, 8, torch.float32, torch.device("cpu"), "native")
    layer.set_slot(0, adapter_parts(LAYOUTS["down"], 8, 0))
    layer.set_slot(0, None)
    context.full = LoRASegments(NUM_ROWS, [(0, 0, NUM_ROWS)])
    out = torch.ones(NUM_ROWS, 24)
    layer.add_to(out, torch.randn(NUM_ROWS, IN))
    assert torch.equal(out, torch.ones(NUM_ROWS, 24)) and not layer.active(NUM_ROWS)


def test_a_layer_picks_the_segments_whose_row_count_matches_its_input() -> None:
    context = LoRAContext(full=LoRASegments(10, [(0, 0, 10)]), kept=LoRASegments(2, [(0, 1, 2)]))
    assert context.segments_for(10) is context.full and context.segments_for(2) is context.kept
    assert context.segments_for(3) is None
