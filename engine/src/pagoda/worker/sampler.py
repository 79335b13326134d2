"""Choosing the next token of every sequence in a batch, and the logprobs reported with it.

Semantics follow vLLM V1 / OpenAI. Logprobs are those of the model's raw logits (before any
penalty, bias or temperature). The token is chosen from the processed logits, in this order:
the allowed_token_ids and bad_words masks, logit_bias, min_tokens masking, repetition penalty, presence/frequency penalties, the structured
output's grammar mask, then greedy argmax, or temperature, top_k, top_p, min_p and a random draw.

Batch independence: a seeded row gets the same token whichever rows share its batch and at
whatever index it sits. All tensor work is row-wise, and the only randomness is one uniform
number per row drawn from that row's own generator, turned into a token by inverse CDF.

No token id outside the vocabulary ever leaves the sampler: a row whose chosen token is out of
range or has a non-finite processed logit (every token masked, or NaN logits from the model) is
reported in ``SamplerOutput.failed_rows`` and its id replaced by 0, so that request alone fails.
The check reads one logit per row, not the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagoda.cpu import argmax_rows
from pagoda.outputs import Logprob
from pagoda.structured_output.grammar import RequestGrammar, apply_grammar_masks
from pagoda.worker import logits_processing as processing
from pagoda.worker.logits_processing import SamplingRow

# Prompt logprobs are computed this many positions at a time to bound the extra memory.
_PROMPT_LOGPROBS_CHUNK = 512


@dataclass(slots=True)
class SamplerOutput:
    """The chosen token of every row and, for rows that asked, its logprobs."""

    token_ids: list[int]  # one per row
    # Per row; None when params.logprobs is None. The sampled token first, then the top
    # params.logprobs tokens in rank order. Ranks are 1-based among the whole vocabulary.
    logprobs: list[Optional[dict[int, Logprob]]]
    # Rows that have no valid token (their id above is a placeholder), with the reason.
    failed_rows: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Picks one token per row of a batch of logits; see the module docstring for semantics."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample from ``logits`` ``[num_rows, vocab]`` (float32, left unmodified)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        processed = _process(logits, rows)
        if any(row.grammar is not None for row in rows):
            # The mask goes last, so no bias or penalty can bring a forbidden token back.
            processed = apply_grammar_masks(processed, _grammars(rows))  # a new tensor: raw logits stay raw
        token_ids = _choose(processed, rows)
        token_ids, failed_rows = _check_chosen(processed, token_ids, rows)
        logprobs = _sampled_logprobs(logits, token_ids, rows)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, failed_rows=failed_rows)


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], k: int) -> list[dict[int, Logprob]]:
    """Logprobs of a prompt's tokens from the logits ``[P, vocab]`` at the positions before them.

    The entry of position ``i`` scores ``next_token_ids[i]`` (the actual next prompt token)
    first, then the ``k`` most likely tokens in rank order.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(next_token_ids), (tuple(logits.shape), len(next_token_ids))
    ids = torch.tensor(list(next_token_ids), dtype=torch.long).to(logits.device)
    result: list[dict[int, Logprob]] = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        end = start + _PROMPT_LOGPROBS_CHUNK
        result.extend(_logprob_entries(logits[start:end], ids[start:end], [k] * len(ids[start:end])))
    return result


def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply bias, min_tokens and penalties; returns a new tensor when anything changes."""
    if not any(_adjusts_logits(row) for row in rows):
        return logits
    out = logits.clone()
    out = processing.apply_allowed_token_ids(out, rows)
    out = processing.apply_bad_words(out, rows)
    out = processing.apply_logit_bias(out, rows)
    out = processing.apply_min_tokens(out, rows)
    return processing.apply_penalties(out, rows)


def _grammars(rows: list[SamplingRow]) -> list[Optional[RequestGrammar]]:
    return [row.grammar for row in rows]


def _adjusts_logits(row: SamplingRow) -> bool:
    p = row.params
    return bool(
        p.logit_bias
        or p.allowed_token_ids
        or p.bad_words_token_ids
        or p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or len(row.output_token_ids) < p.min_tokens
    )


def _choose(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token id per row: argmax for greedy rows, a seeded draw for the others."""
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == len(rows):
        return argmax_rows(logits)
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        index = _long(greedy, logits.device)
        token_ids[index] = argmax_rows(logits[index])
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    params = [rows[i].params for i in rand]
    index = _long(rand, logits.device)
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype).to(logits.device)
    sub = logits[index] / temperature[:, None]  # a fresh tensor, so the filters may work in place
    sub = processing.apply_top_k(sub, [p.top_k for p in params])
    sub = processing.apply_top_p(sub, [p.top_p for p in params])
    sub = processing.apply_min_p(sub, [p.min_p for p in params])
    token_ids[index] = _draw(sub, [rows[i].generator for i in rand])
    return token_ids


def _draw(logits: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """Sample one token per row by inverse CDF with one uniform number from the row's generator."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:]
    u = _uniforms(generators, logits.device)[:, None]
    # Stay strictly below the total so the search lands on a token with non-zero probability.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _uniforms(generators: list[Optional[torch.Generator]], device: torch.device) -> torch.Tensor:
    """One U[0, 1) float32 per generator, gathered on ``device`` (one copy when they share a device)."""
    draws = [
        torch.rand(1, generator=g, device=g.device if g is not None else device, dtype=torch.float32)
        for g in generators
    ]
    if all(d.device == draws[0].device for d in draws):
        return torch.cat(draws).to(device)
    return torch.cat([d.to(device) for d in draws])


NO_TOKEN_LEFT = (
    "no token can be sampled: every token of the vocabulary is excluded (by min_tokens with stop tokens, or by "
    "the structured output's grammar together with logit_bias or min_tokens)"
)
NON_FINITE_LOGITS = "the model produced non-finite logits for this request"


def _check_chosen(
    processed: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> tuple[torch.Tensor, dict[int, str]]:
    """Replace invalid choices by token 0 and say which rows had them and why (one logit read per row)."""
    vocab = processed.shape[1]
    in_range = (token_ids >= 0) & (token_ids < vocab)
    safe_ids = torch.where(in_range, token_ids, torch.zeros_like(token_ids))
    chosen = processed.gather(1, safe_ids[:, None])[:, 0]
    valid = in_range & torch.isfinite(chosen)
    if bool(valid.all()):
        return token_ids, {}
    failed = {}
    for row in (~valid).nonzero()[:, 0].tolist():
        # -inf everywhere is what masking leaves; NaN or +inf come from the logits themselves.
        masked_out = bool(torch.isneginf(processed[row]).all())
        failed[row] = NO_TOKEN_LEFT if masked_out else NON_FINITE_LOGITS
    return safe_ids, failed


def _sampled_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> list[Optional[dict[int, Logprob]]]:
    result: list[Optional[dict[int, Logprob]]] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return result
    index = _long(wanted, raw_logits.device)
    ks = [rows[i].params.logprobs for i in wanted]
    for i, entry in zip(wanted, _logprob_entries(raw_logits[index], token_ids[index], ks)):
        result[i] = entry
    return result


def _logprob_entries(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[dict[int, Logprob]]:
    """Per row: the chosen token's logprob and rank, then the top ``ks[row]`` tokens.

    Non-finite values (only from non-finite logits) are reported as -9999.0, as OpenAI reports
    "impossible", so a response body never holds NaN or infinity."""
    logprobs = logits.float().log_softmax(dim=-1).nan_to_num_(nan=-9999.0, posinf=0.0, neginf=-9999.0)
    chosen_lp = logprobs.gather(1, chosen[:, None])
    # Rank counts the tokens at least as likely as the chosen one (vLLM's convention for ties).
    ranks = (logprobs >= chosen_lp).sum(dim=-1)
    max_k = min(max(ks, default=0), logprobs.shape[1])
    top_vals: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if max_k > 0:
        top = logprobs.topk(max_k, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    entries = []
    for row, (token, value, rank) in enumerate(zip(chosen.tolist(), chosen_lp[:, 0].tolist(), ranks.tolist())):
        entry = {token: Logprob(logprob=value, rank=rank)}
        for j in range(min(ks[row], max_k)):
            entry.setdefault(top_ids[row][j], Logprob(logprob=top_vals[row][j], rank=j + 1))
        entries.append(entry)
    return entries


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
