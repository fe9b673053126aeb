"""Per-slot columns of the running requests' hot counters, for vectorized decode steps.

A busy server's iteration is mostly decodes: every running request gets one token planned
and one token applied. Done a request at a time, that is a Python loop of attribute reads
and list operations per request, twice per iteration, and it was most of the scheduler's
cost at a few hundred running requests. With the counters a decode reads in one array
indexed by slot (the small integer a running request holds, see the scheduler's
docstring), the decode phase becomes a few numpy operations over the batch's slots, and
only the rows that need a decision (a block boundary, a stop, a first token) go through
Python.

``state`` is an int64 matrix with one row per field and one column per slot, read for a
whole batch with one gather (``state.take(slots, axis=1)``, each field then a contiguous
row). Its fields, for a slot held by a running request:

- ``COMPUTED``: the request's ``num_computed_tokens``. This column *is* the value while the
  request holds a slot (:class:`~conveyor.scheduler.request.SchedulerRequest` reads and writes it
  through its property); :meth:`assign` copies it in, :meth:`release` copies it back out.
- ``KNOWN``: ``len(token_ids)``. A mirror: the token list stays the truth, and a slot
  holder's tokens grow only through :meth:`SlotColumns.append_sampled`, which adds one here
  with each token (applying a result appends them all in bulk), and
  :meth:`SlotColumns.append_run` (a speculative decode's further tokens).
- ``GEN``: bumped on every assignment and release, so a plan can tell whether the request it
  planned on a slot still holds it when the result comes back (an abort may free the slot,
  and a later plan may give it to someone else, while the plan is in flight).
- ``STOP_LEN``: the request's ``stop_len``. ``ALARM``: the token count at which a token
  applied needs the per-request path: ``stop_len``, or 0 (always) while its first token is
  due or when it has stop ids beyond the EOS set, so one comparison finds every such row.
- ``EOS``: 1 when a sampled EOS id stops it (not ``ignore_eos``).

``flat`` is a one-dimensional memoryview over the same memory (field ``f`` of slot ``s`` at
``f * num_slots + s``; ``COMPUTED`` is field 0, so at ``s``): scalar reads through it give
Python ints at list speed (the property's path), where numpy would box each one.
``owner``, ``token_lists`` and ``ids`` hold each slot's request, its ``token_ids`` list (the
decode step appends to them in one C-level pass) and its id (output columns are gathered
from it). ``sampled`` is scratch space where a result's tokens are laid out by slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from conveyor.scheduler.request import SchedulerRequest

COMPUTED, KNOWN, GEN, STOP_LEN, ALARM, EOS = range(6)
NUM_FIELDS = 6


class SlotColumns:
    """Hot counters of the running requests, by slot (module docstring)."""

    def __init__(self, num_slots: int, eos_token_ids: Iterable[int]) -> None:
        self.num_slots = num_slots
        self.state = np.zeros((NUM_FIELDS, num_slots), np.int64)
        self.flat = memoryview(self.state).cast("B").cast("q")
        self.computed, self.known = self.state[COMPUTED], self.state[KNOWN]  # (views)
        self.owner: list[SchedulerRequest | None] = [None] * num_slots
        self.token_lists: list[list[int] | None] = [None] * num_slots
        self.ids = np.empty(num_slots, object)
        self.eos_ids = sorted(set(eos_token_ids))
        self.ones = np.ones(num_slots, np.int32)  # a plan's decode counts: a slice of it
        self.ones.flags.writeable = False
        self.sampled = np.empty(num_slots, np.int64)  # scratch: a result's tokens by slot
        self.num_pooling = 0  # slots held by pooling requests (a plan's one-token rows may pool, not sample)

    def assign(self, req: SchedulerRequest, slot: int, eos_stops: bool) -> None:
        """``req`` takes ``slot``: its counters move into the columns (before ``req.slot`` is set)."""
        flat, n = self.flat, self.num_slots
        flat[slot] = req._computed  # (COMPUTED)
        flat[KNOWN * n + slot] = len(req.token_ids)
        flat[GEN * n + slot] += 1
        flat[STOP_LEN * n + slot] = req.stop_len
        flat[ALARM * n + slot] = _alarm(req)
        flat[EOS * n + slot] = eos_stops and bool(self.eos_ids)
        self.owner[slot] = req
        self.token_lists[slot] = req.token_ids
        self.ids[slot] = req.request_id
        self.num_pooling += bool(req.sampling.pooling)

    def release(self, req: SchedulerRequest, slot: int) -> None:
        """``req`` gives ``slot`` back: its computed count moves back into the request."""
        req._computed = self.flat[slot]  # (COMPUTED)
        self.flat[GEN * self.num_slots + slot] += 1
        self.owner[slot] = None
        self.token_lists[slot] = None
        self.ids[slot] = None
        self.num_pooling -= bool(req.sampling.pooling)

    def append_sampled(self, slots: np.ndarray, slot_list: list[int], tokens: list[int]) -> None:
        """Append ``tokens[i]`` to the token list of the request on ``slots[i]`` (distinct
        slots; ``slot_list`` is ``slots.tolist()``), in one C-level pass, and count them in
        ``KNOWN``: the one place a slot holder's tokens grow."""
        deque(map(list.append, map(self.token_lists.__getitem__, slot_list), tokens), maxlen=0)
        self.known[slots] += 1

    def append_run(self, slot: int, tokens: list[int]) -> None:
        """Append ``tokens`` to the request on ``slot`` and count them in ``KNOWN`` (the
        speculative decode's further tokens, after :meth:`append_sampled` gave its first)."""
        self.token_lists[slot].extend(tokens)
        self.known[slot] += len(tokens)

    def generation(self, slot: int) -> int:
        return self.flat[GEN * self.num_slots + slot]

    def first_token_done(self, req: SchedulerRequest) -> None:
        """The request's first token was applied: its later tokens may take the vector path."""
        self.flat[ALARM * self.num_slots + req.slot] = _alarm(req)

    def is_eos(self, tokens: np.ndarray) -> np.ndarray:
        """Which of ``tokens`` are EOS ids (a model has one to a few: a comparison each,
        cheaper than ``np.isin``'s setup at a batch's size)."""
        ids = self.eos_ids
        hit = tokens == ids[0]
        for eos in ids[1:]:
            hit |= tokens == eos
        return hit

    def check(self, running: list[SchedulerRequest]) -> None:
        """The mirrors agree with the running requests (tests; O(slots))."""
        held = {r.slot for r in running}
        for slot in range(self.num_slots):
            owner = self.owner[slot]
            if slot not in held:
                assert owner is None and self.token_lists[slot] is None, f"slot {slot} is free but has an owner"
                continue
            assert owner is not None and owner.slot == slot, f"slot {slot}: owner out of sync"
            row = self.state[:, slot]
            assert self.token_lists[slot] is owner.token_ids, f"{owner.request_id}: token list replaced"
            assert row[KNOWN] == len(owner.token_ids), f"{owner.request_id}: known tokens out of sync"
            assert row[STOP_LEN] == owner.stop_len and self.ids[slot] == owner.request_id
            assert row[ALARM] == _alarm(owner), f"{owner.request_id}: alarm out of sync"


def _alarm(req: SchedulerRequest) -> int:
    """The KNOWN count from which an applied token takes the per-request path (docstring)."""
    return 0 if req.first_token_time is None or req.has_own_stop_ids else req.stop_len
