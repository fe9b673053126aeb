"""Scheduling policy: who waits in what order, who may be admitted, who is preempted.

Kept apart from :mod:`conveyor.scheduler.scheduler`, which does the bookkeeping (token
budget, block allocation, plans, stop conditions) and asks this module only for decisions.
A priority policy with aging, or a head-of-line fix, replaces this class without touching
the bookkeeping.

FCFS as implemented here:
- Waiting requests are served in arrival order; a preempted request goes back to the
  *front*, since it is older than anything still waiting.
- Admission is strictly in order: when the head does not fit, nothing behind it is
  admitted (no skipping; requests that could never fit were rejected at arrival, so the
  head always fits eventually, once running requests finish).
- The head is admitted only when blocks for *all* its known tokens are free, not just
  for its first chunk. Admitting a long prompt into a nearly full pool would let it start
  a chunk and then, being the newest, preempt itself on the next chunk: wasted work.
- The victim of a preemption is the most recently admitted running request; the oldest
  running request is therefore never preempted and always progresses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from conveyor.scheduler.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold the KV of ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class FcfsPolicy:
    """First come, first served over a waiting queue keyed by request id.

    The queue is an OrderedDict so that removing an aborted request from the middle is
    O(1) and a preempted one can be put back at the front in O(1). Live request ids are
    unique (the scheduler rejects duplicates), so the id is a safe key.
    """

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._waiting: OrderedDict[str, Request] = OrderedDict()

    # ------------------------------------------------------------ waiting queue

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._waiting.values())

    def enqueue(self, req: Request) -> None:
        """A new arrival: behind everyone."""
        self._waiting[req.request_id] = req

    def requeue_preempted(self, req: Request) -> None:
        """A preempted request: ahead of everyone (it arrived before all of them)."""
        self._waiting[req.request_id] = req
        self._waiting.move_to_end(req.request_id, last=False)

    def peek(self) -> Request | None:
        """The request to admit next, or None."""
        if not self._waiting:
            return None
        return next(iter(self._waiting.values()))

    def pop(self) -> Request:
        """Remove and return the head (being admitted). The queue must not be empty."""
        return self._waiting.popitem(last=False)[1]

    def remove(self, req: Request) -> bool:
        """Remove a waiting request (aborted); False if it was not queued."""
        if self._waiting.get(req.request_id) is req:
            del self._waiting[req.request_id]
            return True
        return False

    # ------------------------------------------------------------ decisions

    def may_admit_into(self, num_running_at_start: int) -> bool:
        """Whether this iteration may admit anyone, given how many requests were running."""
        return True

    def reserve_for_batch(self, req: Request) -> None:
        """Hook for policies that reserve blocks at admission; FCFS reserves nothing."""

    def batch_started(self) -> None:
        """Called before an iteration's admissions."""

    def can_admit(self, req: Request, num_free_blocks: int) -> bool:
        """Whether the head may start now: all its known tokens must fit in the free blocks."""
        needed = blocks_for(req.num_tokens, self._block_size) - len(req.block_ids)
        return needed <= num_free_blocks

    def pick_victim(self, running: Sequence[Request], first_candidate: int) -> int:
        """Index in ``running`` (admission order) of the request to preempt.

        Only ``running[first_candidate:]`` may be chosen: those before it already have
        their work in this step's plan. The caller guarantees the slice is not empty.
        """
        return len(running) - 1


class StaticBatchPolicy(FcfsPolicy):
    """The static-batching baseline: a batch is formed only when no request is running.

    A batch runs until its last member finishes, so early finishers leave their slots idle:
    the waste continuous batching removes. Members are admitted only when blocks for their
    whole prompt + max_tokens are free, so a batch never preempts itself.
    """

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._reserved = 0  # blocks promised to this batch's members beyond what they hold

    def may_admit_into(self, num_running_at_start: int) -> bool:
        return num_running_at_start == 0

    def can_admit(self, req: Request, num_free_blocks: int) -> bool:
        total = req.num_prompt_tokens + req.sampling.max_tokens
        return blocks_for(total, self._block_size) - len(req.block_ids) <= num_free_blocks - self._reserved

    def reserve_for_batch(self, req: Request) -> None:
        """Hold back blocks the admitted member will grow into, so later members cannot take them."""
        total = req.num_prompt_tokens + req.sampling.max_tokens
        self._reserved += blocks_for(total, self._block_size) - blocks_for(req.num_tokens, self._block_size)

    def batch_started(self) -> None:
        self._reserved = 0
