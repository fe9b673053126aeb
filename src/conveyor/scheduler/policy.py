"""Scheduling policy: the order of the line, when a wave may start, who yields, and how.

Kept apart from the scheduler's bookkeeping (budget, blocks, plans, stop conditions:
:mod:`conveyor.scheduler.scheduler` and the modules of its phases), which asks this module
only for decisions.

**Rank.** Every request gets a rank when it is first queued; smaller goes first, and the
rank orders the waiting queue and the running batch alike (a preempted request goes back
under the same rank, so it keeps its place in line).

- ``fcfs``: arrival order.
- ``priority``: effective priority ``p + aging_rate * waited`` (higher first). For two
  waiting requests the difference of their effective priorities never changes with time,
  so ordering by ``p - aging_rate * arrival`` is the same order at every instant and a
  heap keyed on it never needs re-sorting. The aging bound follows: a request that
  arrived ``w`` seconds after request ``R`` is ranked ahead of ``R`` only if its priority
  exceeds ``R``'s by more than ``aging_rate * w``; so after ``(p_max - p_R) / aging_rate``
  seconds no newcomer can pass ``R`` any more (only the bounded bypass below can).
  Ties go to the earlier arrival.

**Who yields.** Under memory pressure the worst-ranked running request is preempted first
(so the best-ranked one always progresses). Under ``priority`` a waiting request also
preempts worse-ranked running ones when it lacks a slot (``max_num_seqs``) or blocks, but
only if preempting all of them would make it fit: nobody is preempted for nothing.

**Head-of-line blocking.** A request that does not fit in the free blocks now may be passed
by smaller ones behind it, each such admission counting against it; once passed
``max_bypass`` times nobody passes it any more, and it starts when running requests have
freed enough (any accepted request fits the whole pool). At most :data:`BYPASS_LOOKAHEAD`
blocked requests are stepped over per iteration, so that search stays cheap.

**Batch formation.** No admission while fewer than ``min_batch_size`` requests wait, unless
the oldest has waited ``max_wait_ms``. Running requests never wait for this.

**Static batching** (``--batching static``, the baseline benchmarks compare against). A batch
forms only when the last one has left entirely (no request running when a plan starts): its
members are the requests waiting at that moment, best rank first, taken through the same
admission path as continuous batching, as long as each finds a slot and blocks for its
prompt and its whole output beside what the members before it still lack (so a batch never
preempts itself), up to ``max_num_seqs``. Their prompts run in rank order over as many
iterations as the token budget needs (a member decodes from the iteration after its last
chunk, while the prompts after it still run); a member still waiting for its first chunk
already belongs to the batch, and no newcomer joins while one does. The
batch takes nobody more once it has ``max_num_seqs`` members, once a member lacks a slot or
blocks (no bypass: static batching keeps the order of the line), or once the head of the
line is a request that arrived after the batch formed (under ``priority``, a newcomer that
outranks the members still waiting: those start with the next batch). It then runs until
its last member finishes. So only the token budget per iteration, never the size of the
batch, depends on ``max_num_batched_tokens``.

**Swap or recompute.** A victim's KV is either copied to the CPU swap space and back
(``swap``) or dropped and prefilled again (``recompute``); ``auto`` compares
``2 * bytes to move / swap_bandwidth`` with ``tokens to recompute / prefill_rate``. Both
``swap`` and ``auto`` fall back to recompute when the swap space lacks room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from conveyor.runtime.config import Batching, Policy, Preemption, SchedulerConfig

if TYPE_CHECKING:
    from conveyor.scheduler.request import SchedulerRequest

BYPASS_LOOKAHEAD = 8


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold the KV of ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class SchedulingPolicy:
    """The decisions of the module docstring, for one :class:`SchedulerConfig`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.by_priority = config.policy == Policy.PRIORITY
        self.static = config.batching == Batching.STATIC
        self.aging_rate = config.aging_rate
        self.max_bypass = 0 if self.static else config.max_bypass
        self.min_batch_size = config.min_batch_size
        self.max_wait_s = config.max_wait_ms / 1000.0
        # Static batching: the current batch (module docstring). ``_cutoff`` is the last
        # sequence number ranked when it formed (its members are requests up to it), None
        # once it has left; ``_forming`` while it may take more members.
        self._last_seq = 0
        self._cutoff: int | None = None
        self._forming = False
        self._members = 0

    # ------------------------------------------------------------ order

    def rank(self, priority: int, seq: int, arrival: float) -> tuple[float, int]:
        """The fixed sort key of a request; ``arrival`` in seconds since the scheduler started.
        ``seq`` numbers requests in arrival order (``rank[1]``, which static batching reads)."""
        self._last_seq = seq
        if self.by_priority:
            return (self.aging_rate * arrival - priority, seq)
        return (0.0, seq)

    @property
    def preempts_for_admission(self) -> bool:
        """Whether a waiting request may preempt worse-ranked running ones to start."""
        return self.by_priority and not self.static

    # ------------------------------------------------------------ admission

    def may_admit_into(self, num_running_at_start: int, head: SchedulerRequest) -> bool:
        """Whether a plan may admit at all, ``head`` heading the line. Static batching: into
        the batch still forming (its members only, :meth:`may_join`), or into an empty one.
        A batch is empty when nobody runs and no member heads the line: members whose
        first chunk is still to come belong to it, even when every other member has
        finished already."""
        if not self.static:
            return True
        if num_running_at_start == 0 and not (self._forming and self.may_join(head)):
            self._cutoff, self._forming = None, False  # the batch has left: the next one forms
        return self._forming or self._cutoff is None

    @property
    def forming(self) -> bool:
        """Static batching: a batch has members and may take more (they passed the gate of
        :meth:`admission_open` when it formed; the rest of them join without it)."""
        return self._forming

    def may_join(self, req: SchedulerRequest) -> bool:
        """Whether ``req`` may join the running batch: always under continuous batching; under
        static batching, a new batch takes anyone, the batch still forming only requests that
        were waiting when it formed, a complete one nobody."""
        cutoff = self._cutoff
        return cutoff is None or (self._forming and req.rank[1] <= cutoff)

    def joined(self) -> None:
        """A request was admitted. Static batching: the first forms a batch, and the batch
        is complete with ``max_num_seqs`` members."""
        if not self.static:
            return
        if self._cutoff is None:
            self._cutoff, self._forming, self._members = self._last_seq, True, 0
        self._members += 1
        if self._members >= self.config.max_num_seqs:
            self._forming = False

    def batch_formed(self) -> None:
        """Admission stopped short (no slot, no blocks, not a member): a static batch being
        formed is complete, it takes nobody more."""
        self._forming = False

    def admission_open(self, num_waiting: int, oldest_arrival: float | None, now: float) -> bool:
        """Whether a wave may start: enough waiting, or the oldest has waited long enough."""
        if num_waiting >= self.min_batch_size:
            return True
        return oldest_arrival is not None and now - oldest_arrival >= self.max_wait_s

    def admission_opens_at(self, num_waiting: int, oldest_arrival: float | None) -> float | None:
        """When :meth:`admission_open` turns true with no new arrival (None: it already is, or never)."""
        if num_waiting >= self.min_batch_size or oldest_arrival is None:
            return None
        return oldest_arrival + self.max_wait_s

    def growth_reserve(self, num_prompt_tokens: int, max_tokens: int, num_tokens: int) -> int:
        """Blocks an admitted request must leave free for its later growth: its whole output
        under static batching (so a batch never preempts itself), none otherwise."""
        if not self.static:
            return 0
        bs = self.config.block_size
        return blocks_for(num_prompt_tokens + max_tokens, bs) - blocks_for(num_tokens, bs)

    def blocks_lacking(self, req: SchedulerRequest) -> int:
        """Blocks a running request may still claim without preempting anyone: under static
        batching what it lacks for its prompt + max_tokens (the rest of its prompt and its
        whole output), none otherwise (continuous batching preempts under pressure instead)."""
        if not self.static:
            return 0
        total = req.num_prompt_tokens + req.sampling.max_tokens
        return max(0, blocks_for(total, self.config.block_size) - len(req.block_ids))

    def blocks_reserved(self, running: Sequence[SchedulerRequest]) -> int:
        """What the running batch may still claim (:meth:`blocks_lacking` summed): blocks an
        admission must leave free. O(running) under static batching, O(1) otherwise."""
        if not self.static:
            return 0
        return sum(self.blocks_lacking(req) for req in running)

    # ------------------------------------------------------------ preemption

    @staticmethod
    def choose_victim(
        running: Sequence[SchedulerRequest], req: SchedulerRequest, yields: bool
    ) -> SchedulerRequest | None:
        """Who gives up its KV so that ``req`` can run: the worst-ranked running request, if it
        ranks below ``req``. When ``req`` is itself the worst-ranked, it yields (returned) if
        ``yields`` (a decode: rather than stall everyone), else nobody does (None: it waits)."""
        if not running:
            return None
        victim = running[-1]
        if victim is req:
            return req if yields else None
        return victim if victim.rank > req.rank else None

    def preemption_mode(self, blocks_to_move: int, tokens_to_recompute: int, cpu_available: int) -> Preemption:
        """``Preemption.SWAP`` or ``Preemption.RECOMPUTE`` for one victim."""
        mode = self.config.preemption
        if mode == Preemption.RECOMPUTE or not self.config.num_cpu_blocks or tokens_to_recompute == 0:
            return Preemption.RECOMPUTE
        if blocks_to_move > cpu_available:
            return Preemption.RECOMPUTE
        if mode == Preemption.SWAP or blocks_to_move == 0:
            return Preemption.SWAP
        cfg = self.config
        swap_s = 2 * blocks_to_move * cfg.block_bytes / cfg.swap_bandwidth
        recompute_s = tokens_to_recompute / cfg.prefill_rate
        return Preemption.SWAP if swap_s < recompute_s else Preemption.RECOMPUTE
