"""The LoRA kernel cases of benchmarks/gpu_check.py: Triton shrink + expand for a fused q/k/v layer, the batch
spread over four adapters (issue 17's mix), against the plain-torch references."""

from __future__ import annotations

import torch

from gpu_common import KernelCase, Shape, Sizes  # noqa: E402 (the benchmarks folder is not a package)

NUM_ADAPTERS, RANK = 4, 16


def lora_qkv_case(shape: Shape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[KernelCase]:
    """``out += x A^T B^T`` per token's adapter for the q/k/v slices, at decode (batch) and prefill token counts."""
    from pagoda_kernels.lora import (
        lora_expand,
        lora_expand_reference,
        lora_segments,
        lora_shrink,
        lora_shrink_reference,
    )

    slices = (
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    )
    cases = []
    for tokens in (sizes.decode_batch, sizes.tokens):

        def inputs(tokens: int = tokens) -> tuple:
            x = torch.randn(tokens, shape.hidden, dtype=dtype, device=device)
            lora_a = torch.randn(NUM_ADAPTERS, 3 * RANK, shape.hidden, dtype=dtype, device=device) * 0.02
            lora_b = torch.randn(NUM_ADAPTERS, sum(slices), RANK, dtype=dtype, device=device) * 0.02
            token_slots = torch.arange(tokens, device=device) % NUM_ADAPTERS
            mapping = lora_segments(token_slots, NUM_ADAPTERS)
            out = torch.randn(tokens, sum(slices), dtype=dtype, device=device)
            return out, x, lora_a, lora_b, *mapping

        def run(shrink, expand):
            def call(out, x, lora_a, lora_b, sorted_ids, starts, slots):
                expand(out, shrink(x, lora_a, sorted_ids, starts, slots), lora_b, slices, sorted_ids, starts, slots)

            return call

        elem = torch.empty((), dtype=dtype).element_size()
        weights = NUM_ADAPTERS * (3 * RANK * shape.hidden + sum(slices) * RANK) * elem
        moved = weights + tokens * (shape.hidden + 2 * sum(slices)) * elem
        flops = 2 * tokens * (3 * RANK * shape.hidden + sum(slices) * RANK)
        variants = {
            "triton": (run(lora_shrink, lora_expand), inputs),
            "reference": (run(lora_shrink_reference, lora_expand_reference), inputs),
        }
        label = f"{shape.name} {tokens} tok over {NUM_ADAPTERS} adapters, rank {RANK}, q/k/v {slices}"
        cases.append(KernelCase("lora_shrink_expand", label, moved, flops, variants, moved))
    return cases
