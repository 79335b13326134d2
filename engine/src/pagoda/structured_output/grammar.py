"""One sequence's grammar state, and the whole step's token bitmask applied to the logits in one op."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

import torch

from pagoda.cpu import cpu_ops


class RequestGrammar:
    """The matcher of one sequence, created once its grammar has compiled.

    The state is kept across preemption: tokens already generated stay accepted, and a recomputed
    sequence resumes sampling after them, so nothing is rolled back or replayed.
    """

    __slots__ = ("_future", "matcher", "error")

    def __init__(self, future: Future) -> None:
        self._future = future
        self.matcher: Any = None
        self.error: Optional[str] = None

    @property
    def ready(self) -> bool:
        """The grammar is compiled and its matcher exists (see :meth:`poll`)."""
        return self.matcher is not None

    @property
    def future(self) -> Future:
        return self._future

    def poll(self) -> bool:
        """Create the matcher if compilation has finished; True once ``ready`` or ``error`` is set."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        exc = self._future.exception()
        if exc is not None:
            self.error = str(exc) if isinstance(exc, ValueError) else f"grammar compilation failed: {exc!r}"
        else:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self._future.result())
        return True

    def fork(self) -> RequestGrammar:
        """A sibling sequence's state: same grammar, the same position (before any output token)."""
        assert self.matcher is not None, "fork after the grammar is ready"
        child = RequestGrammar(self._future)
        child.matcher = self.matcher.fork()
        return child

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: the output is complete."""
        return bool(self.matcher.is_terminated())


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[Optional[RequestGrammar]]) -> torch.Tensor:
    """The logits with the tokens each row's grammar forbids at -inf, as a new tensor (``logits`` is left
    unmodified; rows without a grammar are copied unchanged, and with no grammar at all ``logits`` itself is
    returned).

    One bitmask ``[rows, ceil(vocab / 32)]`` int32 is filled for the whole batch (xgrammar's batch matcher) and
    applied in one op: the native CPU kernel for float32 CPU logits, else xgrammar's kernel (CUDA on a GPU).
    """
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    assert logits.dim() == 2 and logits.shape[0] == len(grammars), (tuple(logits.shape), len(grammars))
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)  # all allowed: rows without a grammar keep it
    # Each matcher fills one row: filling mutates its scratch state, so the same matcher in two rows (an n > 1
    # request before it forks samples n rows from one state) on two of the batch matcher's threads would race.
    first_row: dict[int, int] = {}
    copies: list[tuple[int, int]] = []
    for i in rows:
        key = id(grammars[i].matcher)
        if key in first_row:
            copies.append((i, first_row[key]))
        else:
            first_row[key] = i
    fill_rows = list(first_row.values())
    _batch_matcher().batch_fill_next_token_bitmask([grammars[i].matcher for i in fill_rows], bitmask, fill_rows)
    for row, source in copies:
        bitmask[row] = bitmask[source]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops():
        return torch.ops.pagoda_cpu.grammar_masked_logits(logits, bitmask, torch.tensor(rows, dtype=torch.long))
    masked = logits.clone()
    if masked.device.type != "cpu":
        bitmask = bitmask.to(masked.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows)
    return masked


def masked_logits_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Plain torch: what ``apply_grammar_masks`` computes from a filled bitmask (bit j of word w allows token
    32 w + j)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [rows, vocab]
    out = logits.clone()
    index = torch.tensor(list(rows), dtype=torch.long)
    out[index] = out[index].masked_fill(~allowed[index], float("-inf"))
    return out


_local = threading.local()


def _batch_matcher() -> Any:
    """One batch matcher (and its thread pool) per engine thread: two engines in one process never share it."""
    matcher = getattr(_local, "batch_matcher", None)
    if matcher is None:
        import xgrammar as xgr

        matcher = _local.batch_matcher = xgr.BatchGrammarMatcher()
    return matcher
