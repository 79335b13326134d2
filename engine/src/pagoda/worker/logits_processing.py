"""Per-row logit adjustments applied before a token is chosen, vectorised over the batch, and
:class:`SamplingRow`, what the sampler knows of each row.

Every function takes the logits of the whole batch (``[num_rows, vocab]``), works only on the
rows that need it and returns a tensor that may be the input itself: callers must pass a
tensor they own. Each row's result depends on that row's data alone, so a request gets the
same logits whatever else shares its batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.grammar import RequestGrammar


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its logits (in place)."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            row_idx.append(i)
            token_idx.append(token_id)
            biases.append(bias)
    if row_idx:
        index = (_long(row_idx, logits.device), _long(token_idx, logits.device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Forbid EOS and stop tokens (in place) for rows that have not yet produced ``min_tokens``."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            row_idx.extend(itertools.repeat(i, len(row.min_tokens_stop_ids)))
            token_idx.extend(row.min_tokens_stop_ids)
    if row_idx:
        index = (_long(row_idx, logits.device), _long(token_idx, logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Forbid (in place) every token outside a row's ``allowed_token_ids``."""
    wanted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if not wanted:
        return logits
    vocab = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for j, i in enumerate(wanted):
        ids = [t for t in rows[i].params.allowed_token_ids or () if t < vocab]
        row_idx.extend(itertools.repeat(j, len(ids)))
        token_idx.extend(ids)
    keep = torch.zeros((len(wanted), vocab), dtype=torch.bool, device=logits.device)
    if row_idx:
        keep[_long(row_idx, logits.device), _long(token_idx, logits.device)] = True
    index = _long(wanted, logits.device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Forbid (in place) the last token of each bad word whose other tokens end the row's output so far
    (vLLM's rule: a one-token word is never sampled; a longer one cannot be completed)."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        output = row.output_token_ids
        for word in row.params.bad_words_token_ids or ():
            prefix = len(word) - 1
            if prefix > len(output) or word[-1] >= vocab:
                continue  # cannot complete here (a token the model never samples cannot either)
            if prefix == 0 or list(output[len(output) - prefix :]) == word[:prefix]:
                row_idx.append(i)
                token_idx.append(word[-1])
    if row_idx:
        index = (_long(row_idx, logits.device), _long(token_idx, logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return logits


class PenaltyCounts:
    """One sequence's token statistics for the penalties, kept up to date as it grows.

    ``prompt_mask`` ``[vocab]`` bool marks the prompt's tokens (built once, only for the repetition
    penalty); ``output_counts`` ``[vocab]`` int32 counts output tokens and takes only the tokens added
    since the last step, so a step costs O(new tokens) instead of O(prompt + output).
    """

    __slots__ = ("prompt_mask", "output_counts", "num_counted")

    def __init__(self, prompt_token_ids: Sequence[int], vocab: int, device: torch.device, with_prompt: bool) -> None:
        self.prompt_mask = None
        if with_prompt:
            self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            if prompt_token_ids:
                self.prompt_mask[_long(list(prompt_token_ids), device)] = True
        self.output_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        self.num_counted = 0

    def update(self, output_token_ids: Sequence[int]) -> None:
        """Count the output tokens added since the last call (the list only ever grows)."""
        assert len(output_token_ids) >= self.num_counted, "output tokens were removed"
        if len(output_token_ids) == self.num_counted:
            return
        new = _long(list(output_token_ids[self.num_counted :]), self.output_counts.device)
        self.output_counts.index_add_(0, new, torch.ones_like(new, dtype=torch.int32))
        self.num_counted = len(output_token_ids)


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    # Per request (or per child of an n > 1 request); any device, CPU is cheapest since only
    # one number per step is drawn from it. None falls back to torch's global generator, which
    # is only right for greedy rows (it loses reproducibility and batch independence).
    generator: Optional[torch.Generator]
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far by this sequence
    # EOS ids + stop_token_ids: forbidden while len(output_token_ids) < params.min_tokens.
    min_tokens_stop_ids: frozenset[int]
    # The sequence's incrementally kept token counts for penalties; None: counted afresh for this call.
    penalty_counts: Optional[PenaltyCounts] = None
    # The structured-output grammar at this sequence's position; None: unconstrained.
    grammar: Optional[RequestGrammar] = None


def penalty_counts(row: SamplingRow, vocab: int, device: torch.device) -> PenaltyCounts:
    """The row's up-to-date counts: its sequence's own when it keeps one, else built for this call."""
    counts = row.penalty_counts
    if counts is None:
        with_prompt = row.params.repetition_penalty != 1.0
        counts = PenaltyCounts(row.prompt_token_ids, vocab, device, with_prompt)
    counts.update(row.output_token_ids)
    return counts


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply repetition, presence and frequency penalties to the rows that ask for them.

    Repetition penalty (HF/vLLM): over the tokens of prompt and output, positive logits are
    divided by the penalty and negative ones multiplied. Presence and frequency penalties
    (OpenAI): over output tokens only, ``logit -= presence * (count > 0) + frequency * count``.
    """
    vocab = logits.shape[1]
    wanted = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not wanted:
        return logits
    counts = {i: penalty_counts(rows[i], vocab, logits.device) for i in wanted}
    rep = [i for i in wanted if rows[i].params.repetition_penalty != 1.0]
    if rep:
        assert all(counts[i].prompt_mask is not None for i in rep), "counts kept without the prompt mask"
        seen = torch.stack([counts[i].prompt_mask | (counts[i].output_counts > 0) for i in rep])
        penalty = _float([rows[i].params.repetition_penalty for i in rep], logits)[:, None]
        sub = logits[_long(rep, logits.device)]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[_long(rep, logits.device)] = torch.where(seen, penalised, sub)
    additive = [i for i in wanted if rows[i].params.presence_penalty != 0.0 or rows[i].params.frequency_penalty != 0.0]
    if additive:
        output_counts = torch.stack([counts[i].output_counts for i in additive]).to(logits.dtype)
        presence = _float([rows[i].params.presence_penalty for i in additive], logits)[:, None]
        frequency = _float([rows[i].params.frequency_penalty for i in additive], logits)[:, None]
        index = _long(additive, logits.device)
        logits[index] = logits[index] - presence * (output_counts > 0) - frequency * output_counts
    return logits


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep the ``top_k[i]`` largest logits of row ``i`` (0 keeps all); ties at the cut-off are kept."""
    vocab = logits.shape[1]
    rows = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    if not rows:
        return logits
    index = _long(rows, logits.device)
    ks = _long([top_k[i] for i in rows], logits.device)
    sub = logits[index]
    # The k-th largest value is exact whatever the largest k of the batch, so rows stay independent.
    kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
    logits[index] = sub.masked_fill(sub < kth, float("-inf"))
    return logits


def apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep, per row, the smallest set of most likely tokens whose probability mass reaches ``top_p``."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return logits
    index = _long(rows, logits.device)
    sub = logits[index]
    sorted_probs, order = sub.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
    # A token is in the nucleus when the mass of the more likely tokens is still short of top_p.
    mass_before = torch.nn.functional.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
    drop_sorted = mass_before >= _float([top_p[i] for i in rows], logits)[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits[index] = sub.masked_fill(drop, float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times that of the most likely token."""
    rows = [i for i, p in enumerate(min_p) if p > 0.0]
    if not rows:
        return logits
    index = _long(rows, logits.device)
    sub = logits[index]
    probs = sub.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * _float([min_p[i] for i in rows], logits)[:, None]
    logits[index] = sub.masked_fill(probs < threshold, float("-inf"))
    return logits


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _float(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)
