"""The waiting queue: a heap ordered by rank, plus an arrival-order line for queue timeouts.

Ranks are fixed when a request is first queued (see :mod:`conveyor.scheduler.policy`), so
the queue never re-sorts: arrival, requeue after preemption and admission are O(log n),
abort is O(1) (the heap entry is marked dead and skipped when it surfaces). The timeout line
holds never-admitted requests in arrival order; :meth:`pop_expired` walks it from the oldest
and stops at the first request still in time, dropping entries of requests that left the
queue meanwhile, so each entry is looked at once: amortized O(1) per request.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from conveyor.scheduler.request import RequestStatus, SchedulerRequest


class WaitingQueue:
    """Waiting, preempted and swapped-out requests, best rank first."""

    def __init__(self) -> None:
        # Entries are [rank, request]; a removed request's entry has its request set to None.
        self._heap: list[list] = []
        self._size = 0
        self._line: deque[SchedulerRequest] = deque()  # never-admitted requests, by arrival

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[SchedulerRequest]:
        """Live entries in heap order (not sorted); O(heap size), for checks and stats."""
        return (entry[1] for entry in self._heap if entry[1] is not None)

    def push(self, req: SchedulerRequest, track_timeout: bool = False) -> None:
        """Queue ``req`` under its (already set) rank; with ``track_timeout`` it also joins
        the arrival line that :meth:`pop_expired` reads."""
        assert req.queue_entry is None, f"{req.request_id} is queued twice"
        entry = [req.rank, req]
        req.queue_entry = entry
        heapq.heappush(self._heap, entry)
        self._size += 1
        if track_timeout:
            self._line.append(req)

    def peek(self) -> SchedulerRequest | None:
        """The best-ranked request, or None."""
        heap = self._heap
        while heap and heap[0][1] is None:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def pop(self) -> SchedulerRequest:
        """Remove and return the best-ranked request. The queue must not be empty."""
        heap = self._heap
        while heap[0][1] is None:
            heapq.heappop(heap)
        req = heapq.heappop(heap)[1]
        req.queue_entry = None
        self._size -= 1
        return req

    def remove(self, req: SchedulerRequest) -> bool:
        """Remove a queued request (aborted, timed out); False if it was not queued."""
        entry = req.queue_entry
        if entry is None:
            return False
        entry[1] = None
        req.queue_entry = None
        self._size -= 1
        if len(self._heap) > 2 * self._size + 64:
            # Mostly dead entries: rebuild, so a burst of aborts cannot bloat the heap.
            self._heap = [e for e in self._heap if e[1] is not None]
            heapq.heapify(self._heap)
        return True

    def pop_expired(self, deadline_arrival: float) -> list[SchedulerRequest]:
        """Remove and return the never-admitted requests that arrived before ``deadline_arrival``."""
        line = self._line
        expired = []
        while line and line[0].enqueue_time < deadline_arrival:
            req = line.popleft()
            if req.status is RequestStatus.WAITING and req.queue_entry is not None:
                self.remove(req)
                expired.append(req)
        return expired

    def oldest_enqueue_time(self, limit: int) -> float | None:
        """The earliest arrival among queued requests, when at most ``limit`` are queued
        (the caller asks only while the queue is short); None when empty or longer."""
        if self._size == 0 or self._size > limit:
            return None
        return min(r.enqueue_time for r in self)

    def next_timeout_arrival(self) -> float | None:
        """Arrival time of the oldest never-admitted request still queued, or None."""
        line = self._line
        while line and not (line[0].status is RequestStatus.WAITING and line[0].queue_entry is not None):
            line.popleft()
        return line[0].enqueue_time if line else None
