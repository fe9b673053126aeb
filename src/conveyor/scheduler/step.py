"""The plan under construction: what one ``schedule()`` call has planned so far.

A :class:`Step` collects a plan's rows while :mod:`~conveyor.scheduler.planning` and
:mod:`~conveyor.scheduler.admission` decide them, becomes a :class:`StepPlan` once formed
(:meth:`Step.cached_columns`, :meth:`Step.commit`), and then stays with the plan while it is
in flight, so that :mod:`~conveyor.scheduler.results` knows which request each row of the
result was planned for.

The plan's cached rows are the phase-1 decodes (one token each), then everything else the
worker already holds (prefill chunks of running requests), in that order. The decodes are
numpy columns by slot (``dslots``, ``dcomputed``; :mod:`~conveyor.scheduler.slot_columns`)
with ``dgens``, the slots' generations when planned: a row whose slot's generation has
changed by the time the result comes back no longer names the request it was planned for.
The other rows are lists (``slots``, ``computed``, ``counts``). ``scheduled`` holds every
request other than the decodes (prefill chunks, admissions) with its token count.

With speculative decoding (:mod:`~conveyor.scheduler.speculation`) a decode may be widened to
verify a proposal: ``spec`` maps its slot to the number of proposed tokens ``k'``, and the
row runs ``1 + k'`` tokens (counted in the budget, the iteration's counters, the computed
count at :meth:`Step.commit` and :meth:`Step.tokens_of`). ``proposals`` holds the tokens of
the n-gram proposer's rows; the draft method's are made by the worker, which is told only
``k'`` (``CachedRequests.spec_draft_counts``).
"""

from __future__ import annotations

import numpy as np

from conveyor.ipc.messages import CachedRequests, NewRequestData
from conveyor.scheduler.request import SchedulerRequest
from conveyor.scheduler.slot_columns import GEN, SlotColumns

_NO_ROWS = np.empty(0, np.int64)
_NO_ROWS.flags.writeable = False


class Step:
    """One plan's rows, its token budget left, and its counters for the iteration log.

    Once committed, ``sample_slots`` / ``sample_gens`` name the rows that sample a token
    with their slots' generations: the rows a result must answer, every decode, then each
    other request whose chunk ends its known tokens, in ``scheduled`` order (the order their
    results are applied in). The worker answers them in plan order, ``answer_slots``: the
    new requests first, then the cached rows; where that differs, row ``i`` is answer row
    ``answer_rows[i]`` (None: the same order).
    """

    __slots__ = (
        "budget",
        "dslots",
        "dcomputed",
        "dgens",
        "_owners",
        "_decodes",
        "_row_gen",
        "scheduled",
        "new",
        "slots",
        "computed",
        "counts",
        "block_rows",
        "block_ids",
        "sample_slots",
        "sample_gens",
        "answer_slots",
        "answer_rows",
        "preempted",
        "num_swap",
        "num_recompute",
        "num_admitted",
        "wait_sum",
        "wait_max",
        "hit_tokens",
        "decode_tokens",
        "prefill_tokens",
        "context_tokens",
        "swapped_out",
        "_tokens_by_request",
        "failed",
        "copies",
        "spec",
        "proposals",
        "poolers",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.dslots = self.dcomputed = self.dgens = _NO_ROWS
        self.sample_slots = self.sample_gens = self.answer_slots = _NO_ROWS
        self.answer_rows: np.ndarray | None = None
        self._owners: list[SchedulerRequest | None] | None = None  # slot -> request, when the plan was formed
        self._decodes: list[SchedulerRequest] | None = None
        self._row_gen: np.ndarray | None = None
        self.scheduled: list[tuple[SchedulerRequest, int]] = []
        self.new: list[NewRequestData] = []
        self.slots: list[int] = []
        self.computed: list[int] = []
        self.counts: list[int] = []
        self.block_rows: list[int] = []
        self.block_ids: list[list[int]] = []
        self.preempted: set[int] = set()  # id() of requests preempted in this iteration
        self.swapped_out: list[SchedulerRequest] = []  # of those, the ones swapped out
        self._tokens_by_request: dict[SchedulerRequest, int] | None = None
        self.copies: list[list[int]] = []  # [src, dst] block copies of forks (StepPlan.copy_blocks)
        self.spec: dict[int, int] = {}  # slot -> tokens proposed, of the widened decodes (rank order)
        self.proposals: dict[int, list[int]] = {}  # slot -> the proposed tokens, where the scheduler made them
        # Pooling requests whose last prompt chunk this plan runs: they sample nothing, the
        # result carries their vectors (StepResult.pooled) and they finish with it.
        self.poolers: list[SchedulerRequest] = []
        self.failed = False  # planned ahead of a plan that failed: failed with it, its result is moot
        self.num_swap = self.num_recompute = self.num_admitted = self.hit_tokens = 0
        self.decode_tokens = self.prefill_tokens = self.context_tokens = 0
        self.wait_sum = self.wait_max = 0.0

    @property
    def is_empty(self) -> bool:
        return not len(self.dslots) and not self.scheduled

    @property
    def decodes(self) -> list[SchedulerRequest]:
        """The decodes' requests, in row order (built on demand: the hot paths use the columns)."""
        if self._decodes is None:
            owners = self._owners
            assert owners is not None, "decodes asked for before the plan was formed"
            self._decodes = [owners[s] for s in self.dslots.tolist()]
        return self._decodes

    # ------------------------------------------------------------------ forming

    def add_decodes(
        self, slots: np.ndarray, computed: np.ndarray, gens: np.ndarray, block_rows: list[int], blocks: list[int]
    ) -> None:
        """Running requests decode one token each (slot columns, in rank order); ``blocks[i]``
        is the new block of the ``block_rows[i]``-th of them. Phase 1 only, before any other row."""
        n = len(slots)
        if len(self.dslots):  # a later run of decodes, after a preemption (rare)
            offset = len(self.dslots)
            self.dslots = np.concatenate((self.dslots, slots))
            self.dcomputed = np.concatenate((self.dcomputed, computed))
            self.dgens = np.concatenate((self.dgens, gens))
            block_rows = [row + offset for row in block_rows]
        else:
            self.dslots, self.dcomputed, self.dgens = slots, computed, gens
        if block_rows:
            self.block_rows += block_rows
            self.block_ids += [[block] for block in blocks]
        self.decode_tokens += n
        self.context_tokens += int(np.add.reduce(computed)) + n
        self.budget -= n

    def add_speculation(self, row: int, slot: int, n: int, blocks: list[int], proposal: list[int] | None) -> None:
        """Widen decode ``row`` (on ``slot``) to verify ``n`` proposed tokens: ``proposal``, or
        (None) tokens the worker's draft model makes; ``blocks`` are new blocks of its request
        for those tokens (after any the decode itself got). Before phase 2."""
        self.spec[slot] = n
        if proposal is not None:
            self.proposals[slot] = proposal
        self.budget -= n
        self.decode_tokens += n
        self.context_tokens += n
        if blocks:
            if row in self.block_rows:
                self.block_ids[self.block_rows.index(row)] = self.block_ids[self.block_rows.index(row)] + blocks
            else:
                at = sum(1 for r in self.block_rows if r < row)
                self.block_rows.insert(at, row)
                self.block_ids.insert(at, blocks)

    def add_cached(self, req: SchedulerRequest, n: int, new_blocks: list[int]) -> None:
        """A request the worker holds runs ``n`` more tokens (not a phase-1 decode)."""
        if new_blocks:
            self.block_rows.append(len(self.dslots) + len(self.slots))
            self.block_ids.append(new_blocks)
        self.slots.append(req.slot)
        self.computed.append(req.num_computed_tokens)
        self.counts.append(n)
        self.add_scheduled(req, n)

    def add_scheduled(self, req: SchedulerRequest, n: int) -> None:
        """``req`` runs ``n`` tokens in this plan (a prefill chunk, or an admission's first)."""
        self.scheduled.append((req, n))
        self.count(req, n, +1)
        self.budget -= n

    def count(self, req: SchedulerRequest, n: int, sign: int) -> None:
        """Keep the iteration's token counters (for the iteration log) in step with the plan."""
        if n == 1 and len(req.token_ids) - req.num_computed_tokens <= 1:  # (< 1: its input is pending)
            self.decode_tokens += sign
        else:
            self.prefill_tokens += sign * n
        self.context_tokens += sign * (req.num_computed_tokens + n)

    def unschedule(self, req: SchedulerRequest) -> None:
        """Take a request preempted after it was planned back out of the plan (rare path;
        only a plan being formed, before :meth:`commit`)."""
        hits = np.flatnonzero(self.dslots == req.slot)
        if len(hits):
            row = int(hits[0])
            self.dslots = np.delete(self.dslots, row)
            self.dcomputed = np.delete(self.dcomputed, row)
            self.dgens = np.delete(self.dgens, row)
            self.budget += 1
            self.count(req, 1, -1)
            proposed = self.spec.pop(req.slot, 0)
            self.proposals.pop(req.slot, None)
            self.budget += proposed
            self.decode_tokens -= proposed
            self.context_tokens -= proposed
        else:
            for k, (r, n) in enumerate(self.scheduled):
                if r is req:
                    del self.scheduled[k]
                    self.budget += n
                    self.count(req, n, -1)
                    break
            else:
                return
            assert req.slot not in {d.slot for d in self.new}, "a request admitted this step was preempted"
            row = len(self.dslots) + self.slots.index(req.slot)
            k = row - len(self.dslots)
            del self.slots[k], self.computed[k], self.counts[k]
        rows, blocks = [], []
        for r, b in zip(self.block_rows, self.block_ids):
            if r != row:
                rows.append(r - (r > row))
                blocks.append(b)
        self.block_rows, self.block_ids = rows, blocks

    # ------------------------------------------------------------------ formed

    def cached_columns(self, cols: SlotColumns) -> CachedRequests:
        """The plan's cached rows as int32 columns: the decodes, then the other rows."""
        n = len(self.dslots)
        spec_rows, spec_counts = self._spec_rows()
        if not self.slots and not spec_rows:
            return CachedRequests(
                self.dslots.astype(np.int32),
                self.dcomputed.astype(np.int32),
                cols.ones[:n],
                self.block_rows,
                self.block_ids,
            )
        counts = np.ones(n, np.int64)
        if spec_rows:
            counts[spec_rows] += spec_counts
        drafted = not self.proposals  # the draft method: the worker makes the proposals
        return CachedRequests(
            np.concatenate((self.dslots, self.slots)).astype(np.int32),
            np.concatenate((self.dcomputed, self.computed)).astype(np.int32),
            np.concatenate((counts, self.counts)).astype(np.int32),
            self.block_rows,
            self.block_ids,
            spec_rows,
            [] if drafted else [self.proposals[slot] for slot in self.dslots[spec_rows].tolist()],
            spec_counts if drafted else [],
        )

    def _spec_rows(self) -> tuple[list[int], list[int]]:
        """The widened decodes' rows (increasing) and how many tokens each proposes."""
        if not self.spec:
            return [], []
        pairs = sorted((row, self.spec[slot]) for row, slot in enumerate(self.dslots.tolist()) if slot in self.spec)
        return [row for row, _ in pairs], [n for _, n in pairs]

    def commit(self, cols: SlotColumns) -> None:
        """The plan is formed: count it as run. Every request it schedules advances by what it
        runs (the tokens it samples are pending until the result appends them), and the rows
        that sample are noted with their slots' generations (class docstring)."""
        self._owners = cols.owner.copy()
        cols.computed[self.dslots] += 1  # (slots are distinct within a plan)
        for slot, proposed in self.spec.items():
            cols.computed[slot] += proposed
        dslots, dgens = self.dslots, self.dgens  # the decodes that sample
        if cols.num_pooling and len(dslots):  # a pooling request's last prompt token is pooled
            pooled = np.fromiter(
                (bool(self._owners[s].sampling.pooling) for s in dslots.tolist()), np.bool_, len(dslots)
            )
            if pooled.any():
                self.poolers += [self._owners[s] for s in dslots[pooled].tolist()]
                dslots, dgens = dslots[~pooled], dgens[~pooled]
        self.sample_slots = self.answer_slots = dslots
        self.sample_gens = dgens
        if not self.scheduled:
            return
        new_slots = {d.slot for d in self.new}
        samplers: list[int] = []  # in ``scheduled`` order
        answered_first: list[int] = []  # of those, the new requests: the worker answers them first
        for req, n in self.scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == len(req.token_ids):  # the chunk ends the prompt: it samples
                if req.sampling.pooling:  # (or, pooling, is pooled)
                    self.poolers.append(req)
                    continue
                samplers.append(req.slot)
                if req.slot in new_slots:
                    answered_first.append(req.slot)
        if not samplers:
            return
        slots = self.sample_slots = np.concatenate((dslots, np.array(samplers, np.int64)))
        self.sample_gens = cols.state[GEN].take(slots)  # (the decodes' are still their dgens)
        if answered_first:  # the worker's order differs from the rows': map it (class docstring)
            answered_last = [slot for slot in samplers if slot not in new_slots]
            self.answer_slots = np.concatenate(
                (np.array(answered_first, np.int64), dslots, np.array(answered_last, np.int64))
            )
            nf, nd = len(answered_first), len(dslots)
            first, last = iter(range(nf)), iter(range(nf + nd, len(slots)))
            rows = [next(first) if slot in new_slots else next(last) for slot in samplers]
            self.answer_rows = np.concatenate((np.arange(nf, nf + nd), np.array(rows, np.int64)))
        else:
            self.answer_slots = slots

    def owner(self, slot: int) -> SchedulerRequest | None:
        """The request this (committed) plan ran on ``slot``."""
        return self._owners[slot] if self._owners is not None and 0 <= slot < len(self._owners) else None

    def tokens_of(self, req: SchedulerRequest, cols: SlotColumns) -> int:
        """Tokens this (formed) plan computes for ``req``, a live request; 0 if it is not in it."""
        slot = req.slot
        if slot >= 0 and len(self.dslots):
            row_gen = self._row_gen
            if row_gen is None:
                row_gen = self._row_gen = np.full(cols.num_slots, -1, np.int64)
                row_gen[self.dslots] = self.dgens
            if row_gen[slot] == cols.generation(slot):  # planned as a decode on the slot it still holds
                return 1 + self.spec.get(slot, 0)
        by_request = self._tokens_by_request
        if by_request is None:
            by_request = self._tokens_by_request = dict(self.scheduled)  # keyed by identity
        return by_request.get(req, 0)
