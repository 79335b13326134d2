"""One step's plan as plain data: what every tensor-parallel rank runs, and what rank 0 keeps to sample.

Rank 0's runner turns the scheduler's output into a :class:`ForwardStep` (lists only: the multiprocess executor
sends it to the other ranks pickled), every rank runs it and returns :class:`StepLogits` (rank 0 only), and rank 0
samples from those with the requests it kept in :class:`PreparedStep`. A speculative proposer plugs in between:
its draft tokens are more rows of the same ``ForwardStep``, and verifying them is the sampling step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagoda.core.scheduler_output import ScheduledRequest
from pagoda.lora.slots import LoRARun
from pagoda.request import Request


@dataclass(slots=True)
class ForwardStep:
    """What every tensor-parallel rank needs to run one step (plain lists: sent to the other ranks pickled)."""

    block_copies: list[tuple[int, int]]  # (src, dst) blocks to copy before the forward (copy-on-write)
    token_ids: list[int]  # [num_tokens] the flat batch
    query_lens: list[int]  # per scheduled request
    seq_lens: list[int]
    block_tables: list[list[int]]
    # The rows the forward returns when it need not return all (the sampled ones, no prompt logprobs): the last
    # layer then skips the rest. None: every token's row.
    output_rows: Optional[list[int]]
    prompt_logprob_spans: list[tuple[int, int]]  # (first flat index, count) whose logits score the prompt
    sample_rows: list[int]  # rows of the forward's output whose logits are sampled


@dataclass(slots=True)
class StepLogits:
    """Rank 0's logits of one step (float32): one tensor per prompt-logprob span, and the sampled rows'."""

    prompt: list[torch.Tensor]
    sample: Optional[torch.Tensor]  # [num_sampling_reqs, vocab]; None when nothing samples


@dataclass(slots=True)
class PreparedStep:
    """Rank 0's view of a step: the forward every rank runs, the requests that sample (in logits order) and the
    prompt-logprob spans (request, first flat index, count)."""

    forward: ForwardStep
    sample_requests: list[Request]
    spans: list[tuple[Request, int, int]]


def plan_forward(block_copies: list[tuple[int, int]], scheduled: list[ScheduledRequest]) -> PreparedStep:
    """Flatten the scheduled chunks into one step (``scheduled`` in the order their rows run)."""
    forward = ForwardStep(list(block_copies), [], [], [], [], None, [], [])
    sample_requests: list[Request] = []
    spans: list[tuple[Request, int, int]] = []
    for item in scheduled:
        request, start = item.request, item.request.num_computed_tokens
        end = start + item.num_tokens
        flat_start = len(forward.token_ids)
        forward.token_ids.extend(request.all_token_ids[start:end])
        forward.query_lens.append(item.num_tokens)
        forward.seq_lens.append(end)
        forward.block_tables.append(item.block_ids)
        if request.pending_prompt_logprobs:
            # position p scores prompt token p + 1; the last prompt position samples instead
            count = min(end, request.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append((request, flat_start, count))
        if item.samples:
            sample_requests.append(request)
            forward.sample_rows.append(len(forward.token_ids) - 1)
    # A prompt chunk: most rows only feed the cache. (A step that samples nothing keeps every row: no kernel then
    # sees an empty batch.)
    if not spans and 0 < len(forward.sample_rows) < len(forward.token_ids):
        forward.output_rows = list(forward.sample_rows)
    forward.prompt_logprob_spans = [(start, count) for _, start, count in spans]
    return PreparedStep(forward, sample_requests, spans)


def lora_runs(scheduled: list[ScheduledRequest], prepared: PreparedStep) -> tuple[list[LoRARun], Optional[list]]:
    """(lora id, first row, end row) runs over the flat batch, and over the rows the last layer keeps (None: all).
    ``scheduled`` is grouped by adapter, so consecutive equal ids merge into one run."""
    runs: list[list] = []
    row = 0
    for item in scheduled:
        _extend_run(runs, item.request.lora_id, row, row + item.num_tokens)
        row += item.num_tokens
    kept: Optional[list[list]] = None
    if prepared.forward.output_rows is not None:
        kept = []
        for index, request in enumerate(prepared.sample_requests):
            _extend_run(kept, request.lora_id, index, index + 1)
    return [tuple(r) for r in runs], None if kept is None else [tuple(r) for r in kept]


def _extend_run(runs: list[list], lora_id: Optional[int], start: int, end: int) -> None:
    if runs and runs[-1][0] == lora_id and runs[-1][2] == start:
        runs[-1][2] = end
    else:
        runs.append([lora_id, start, end])
