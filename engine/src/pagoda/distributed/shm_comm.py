"""All-reduce and gather between the tensor-parallel ranks of one CPU host through shared memory.

gloo sends every collective through loopback TCP: ~0.1-0.8 ms for a [1, 1024] all-reduce, and a decode step makes
two per layer. Here each rank copies its tensor into its slot of one shared segment, raises its flag, waits for
every other rank's flag, and sums the slots itself (the same adds in the same rank order on every rank, so the
ranks hold bit-identical results, as they must). Tensors larger than a slot go through gloo instead; every rank
takes the same path because the ranks' tensors have the same shapes.

Synchronisation is one counter per rank in its own cache line: call ``s`` writes ``s`` once the data is in place
and waits for the others to reach ``s``. Slots alternate between two sets by the call's parity, so a rank that
runs ahead to call ``s + 1`` never overwrites data another rank may still be reading from call ``s`` (that rank
would have to have raised ``s + 1`` first). Stores become visible in program order on x86 (TSO) and a torch copy
joins its threads before returning, so a raised flag means the slot is complete. A dead rank is noticed through the
abort word (the engine's watchdog sets it) and a hung one after ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Optional

import torch

_LINE = 64  # bytes: one flag per cache line, so ranks never write the same line
_SPINS_BEFORE_YIELD = 2000
_SPINS_BEFORE_SLEEP = 100 * _SPINS_BEFORE_YIELD  # ~tens of ms of spinning and yielding
_BACKOFF_SLEEP_S = 200e-6
DEFAULT_SLOT_BYTES = 32 * 2**20  # per rank and parity; pages are only committed when touched


def segment_path() -> str:
    """A fresh file name in /dev/shm (memory-backed), or the temp dir where there is none."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return str(folder / f"pagoda-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


class ShmCommunicator:
    """One rank's view of the segment at ``path`` (rank 0 creates it; see :func:`segment_path`)."""

    def __init__(self, path: str, rank: int, world_size: int, timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES):
        assert slot_bytes % _LINE == 0, slot_bytes
        self.path, self.rank, self.world_size, self.timeout_s = path, rank, world_size, timeout_s
        self.slot_bytes = slot_bytes
        self._data_offset = _LINE * (1 + world_size)  # the abort word's line, then one flag line per rank
        size = self._data_offset + 2 * world_size * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if rank == 0 else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if rank == 0:
                # Commit the pages now: a /dev/shm too small for the segment is an error here (the caller then uses
                # gloo), not a SIGBUS at the first large write.
                os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except OSError:
            if rank == 0:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")  # int64 words: [0] abort, [8 * (1 + r)] rank r's counter
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._seq = 0

    def unlink(self) -> None:
        """Remove the name (rank 0, once every rank has mapped it: the memory lives on until the last unmap)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def abort(self) -> None:
        """Make every rank's current and future waits fail at once (a rank died)."""
        self._words[0] = 1

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` over the ranks in place; False (nothing done) when it does not fit a slot."""
        slots = self._exchange(tensor)
        if slots is None:
            return False
        torch.add(slots[0], slots[1], out=tensor)  # the same adds in the same order on every rank
        for other in slots[2:]:
            tensor.add_(other)
        return True

    def gather_to_first(self, tensor: torch.Tensor) -> tuple[bool, Optional[torch.Tensor]]:
        """(done, the ranks' [n, k] tensors side by side as [n, world_size * k] on rank 0, None elsewhere)."""
        slots = self._exchange(tensor)
        if slots is None:
            return False, None
        return True, (torch.cat(slots, dim=-1) if self.rank == 0 else None)

    def _exchange(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Publish ``tensor`` and wait for every rank's; views of all ranks' slots, or None if it is too big."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes or not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        self._seq += 1
        views = [self._slot(self._seq % 2, r, tensor, nbytes) for r in range(self.world_size)]
        views[self.rank].copy_(tensor)
        self._words[8 * (1 + self.rank)] = self._seq
        self._wait_for_all(self._seq)
        return views

    def _slot(self, parity: int, rank: int, like: torch.Tensor, nbytes: int) -> torch.Tensor:
        start = self._data_offset + (parity * self.world_size + rank) * self.slot_bytes
        return self._bytes[start : start + nbytes].view(like.dtype).view(like.shape)

    def _wait_for_all(self, seq: int) -> None:
        words = self._words
        deadline = None
        for rank in range(self.world_size):
            spins = 0
            while words[8 * (1 + rank)] < seq:
                if words[0]:
                    raise RuntimeError("tensor-parallel shared-memory exchange aborted: a rank died")
                spins += 1
                if spins % _SPINS_BEFORE_YIELD == 0:
                    # Ranks run in near lockstep, so waits are short; a long one (a hung rank, more ranks than free
                    # cores) backs off from a yield to short sleeps instead of burning a core for the whole timeout.
                    if spins < _SPINS_BEFORE_SLEEP:
                        os.sched_yield()
                    else:
                        time.sleep(_BACKOFF_SLEEP_S)
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise RuntimeError(
                            f"tensor-parallel rank {rank} did not reach the exchange within {self.timeout_s:.0f} s"
                        )

    def close(self) -> None:
        """Unmap (best effort: a tensor still viewing a slot keeps the mapping alive until it is freed)."""
        del self._bytes
        with contextlib.suppress(BufferError):
            self._words.release()
            self._map.close()


def shared_memory_enabled() -> bool:
    """Only on x86 (the flag protocol relies on its store order); ``PAGODA_TP_SHM=0`` sends every CPU collective
    through gloo (for debugging and the benchmark baseline)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("PAGODA_TP_SHM", "1") != "0"


def slot_bytes_for(tensor_bytes: int) -> int:
    """A slot for the largest collective of the model (rounded up to a cache line), at most the default."""
    return min(DEFAULT_SLOT_BYTES, -(-tensor_bytes // _LINE) * _LINE)
