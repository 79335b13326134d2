"""The scheduler's waiting queue, one per scheduling policy (``--scheduling-policy``).

``fcfs``: arrival order; a preempted request goes back to the front. ``priority``: the lowest ``priority`` value
first, ties by arrival (time, then the engine's arrival order); a preempted request re-enters by the same key, so
there is no "front" to put it at. Under memory pressure the scheduler preempts :func:`preemption_victim`: the
latest arrival (fcfs), or the lowest-priority running request, latest arrival among equals (priority). As in
vLLM's V1 scheduler, a waiting request never preempts a running one: it is admitted first once room frees up.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from pagoda.request import Request

POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, float, int]:
    """The priority policy's order: lower value first, then earlier arrival."""
    return request.priority, request.arrival_time, request.arrival_seq


def preemption_victim(running: Iterable[Request], policy: str) -> Request:
    """The running request to preempt when blocks run out: the one the policy would schedule last."""
    if policy == "priority":
        return max(running, key=priority_key)
    return max(running, key=lambda r: r.arrival_seq)


class RequestQueue(Protocol):
    """What the scheduler needs of its waiting queue."""

    def add(self, request: Request) -> None:
        """Queue a new arrival."""

    def prepend(self, request: Request) -> None:
        """Queue a preempted request (fcfs: at the front)."""

    def restore(self, requests: list[Request]) -> None:
        """Put back requests that were popped in queue order (``requests`` in that order) and not admitted."""

    def peek(self) -> Request:
        """The next request to admit."""

    def pop(self) -> Request:
        """Remove and return the next request to admit."""

    def remove(self, request: Request) -> None:
        """Remove a queued request wherever it is."""

    def priority_counts(self) -> dict[int, int]:
        """Queued requests by priority value."""

    def __len__(self) -> int: ...

    def __bool__(self) -> bool: ...

    def __iter__(self) -> Iterator[Request]: ...


class _Counts:
    """Queued requests by priority value, kept as requests come and go."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    def priority_counts(self) -> dict[int, int]:
        return dict(self._counts)

    def _count(self, request: Request, delta: int) -> None:
        left = self._counts.get(request.priority, 0) + delta
        if left:
            self._counts[request.priority] = left
        else:
            del self._counts[request.priority]


class FCFSQueue(_Counts):
    """Arrival order (a deque); preempted requests go back at the front."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)
        self._count(request, 1)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)
        self._count(request, 1)

    def restore(self, requests: list[Request]) -> None:
        for request in reversed(requests):
            self.prepend(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        request = self._queue.popleft()
        self._count(request, -1)
        return request

    def remove(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)
        self._count(request, -1)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(_Counts):
    """A min-heap on :func:`priority_key`: O(log n) add and pop, O(1) remove.

    Removal is lazy: ``_live`` maps each queued request to the sequence number of its current heap entry, and an
    entry whose number is not the live one (removed, or re-added since) is dropped when it reaches the top.
    """

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, int, Request]] = []
        self._live: dict[Request, int] = {}
        self._entries = itertools.count()

    def add(self, request: Request) -> None:
        assert request not in self._live, f"{request.request_id} is already queued"
        entry = next(self._entries)
        self._live[request] = entry
        self._count(request, 1)
        heapq.heappush(self._heap, (*priority_key(request), entry, request))
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly dead entries (many aborts): rebuild, amortized O(1)
            self._heap = [item for item in self._heap if self._live.get(item[4]) == item[3]]
            heapq.heapify(self._heap)

    def prepend(self, request: Request) -> None:
        self.add(request)  # a preempted request keeps its key: priority has no front

    def restore(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        self._drop_dead()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][4]

    def pop(self) -> Request:
        request = self.peek()
        heapq.heappop(self._heap)
        self._forget(request)
        return request

    def remove(self, request: Request) -> None:
        if request not in self._live:
            raise ValueError(f"{request.request_id} is not queued")
        self._forget(request)

    def _forget(self, request: Request) -> None:
        del self._live[request]
        self._count(request, -1)

    def _drop_dead(self) -> None:
        while self._heap and self._live.get(self._heap[0][4]) != self._heap[0][3]:
            heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        """In admission order (a sorted copy: for inspection, not for the scheduling loop)."""
        return iter(sorted(self._live, key=lambda r: (*priority_key(r), self._live[r])))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of a scheduling policy (``fcfs`` or ``priority``)."""
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
