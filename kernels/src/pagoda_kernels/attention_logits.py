"""Attention-logit pieces the decode and extend kernels share: the soft cap and the sinks, in Triton and in torch.

A logit soft cap (Gemma 2) maps a scaled score ``s`` to ``cap * tanh(s / cap)`` before the causal / window mask.
Sinks (gpt-oss) are one learned logit per query head: an extra softmax column whose probability is dropped, so a
row's weights sum below one. The kernels keep scores in log2 units (for ``exp2``), so both enter there.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))  # a constexpr: Triton reads module globals only as those


@triton.jit
def soft_cap_log2(s, cap):
    """``cap * tanh(s / cap) * log2(e)``: a soft-capped score (fp32) moved into the exp2 domain.

    tanh is written with exp2 of a non-positive argument (no overflow for any s), because libdevice's tanh has no
    interpreter implementation; its absolute error stays near fp32 epsilon, times cap.
    """
    x = s / cap
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|): -2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * (cap * 1.4426950408889634)


@triton.jit
def with_sinks(acc, m_i, l_i, sink):
    """``acc / (l_i + exp(sink))`` in a shared frame: the normalised output of an online softmax (running max m_i,
    base 2) once a sink logit (already in log2 units) joins its denominator. NaN-free when nothing was seen
    (m_i = -inf, l_i = 0, acc = 0: zeros)."""
    m_all = tl.maximum(m_i, sink)
    keep = tl.exp2(m_i - m_all)
    return acc * (keep / (l_i * keep + tl.exp2(sink - m_all)))[:, None]


def check_soft_cap_and_sinks(q: torch.Tensor, logits_soft_cap: Optional[float], sinks: Optional[torch.Tensor]) -> None:
    """Raise ValueError unless the soft cap is None or a positive finite float and sinks None or [num_heads] on
    q's device (q: [tokens, num_heads, head_dim])."""
    if logits_soft_cap is not None and not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap}")
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(
            f"sinks must be [num_heads={q.shape[1]}] on {q.device}, got {tuple(sinks.shape)} on {sinks.device}"
        )


def reference_softmax(
    scores: torch.Tensor,  # [num_heads, q_len, n] or [num_heads, n] fp32, already scaled
    logits_soft_cap: Optional[float],
    visible: Optional[torch.Tensor],  # bool, broadcast to scores' shape (True = attend), or None: all visible
    sinks: Optional[torch.Tensor],  # [num_heads] or None
) -> torch.Tensor:
    """The attention weights of the plain references: soft cap, mask, then a softmax that with sinks has one more
    column per head (the head's sink logit) whose probability is dropped."""
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
