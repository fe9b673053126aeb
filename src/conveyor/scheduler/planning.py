"""Planning one iteration: the decodes (phase 1), then prompts by rank (phase 2).

:meth:`Scheduler.schedule` calls :func:`plan_decodes`, then :func:`plan_prompts`; both add
rows to the :class:`~conveyor.scheduler.step.Step` being formed, within its token budget.
Admissions are :mod:`~conveyor.scheduler.admission`'s, preemptions
:mod:`~conveyor.scheduler.preemption`'s.

Phase 1 is the steady state of a busy server and the scheduler's hottest code, so it works
on the slot columns (:mod:`~conveyor.scheduler.slot_columns`): the decodes that fit the
budget and the available blocks are planned in one run of numpy operations, and Python
touches only the requests still prefilling and those at a block boundary. A decode that
needs a block and finds none ends the run: it makes room (preempting the worst-ranked
running request, itself if it is the worst) and the next run starts from it. So the rule
is applied a request at a time in rank order, in as few runs as there are preemptions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from conveyor.scheduler.admission import NO_BLOCKS, NO_LORA_SLOT, try_admit
from conveyor.scheduler.policy import BYPASS_LOOKAHEAD
from conveyor.scheduler.preemption import make_room
from conveyor.scheduler.request import RequestStatus, SchedulerRequest
from conveyor.scheduler.slot_columns import COMPUTED, GEN, KNOWN, STOP_LEN
from conveyor.scheduler.step import Step

if TYPE_CHECKING:
    from conveyor.scheduler.state import SchedulerState

RUNNING = RequestStatus.RUNNING


def plan_decodes(state: SchedulerState, step: Step, prefills: list[SchedulerRequest]) -> bool:
    """Phase 1: every running request with one token to run gets it, best rank first, while
    the budget lasts; one at a block boundary gets a block, making room if none is left.
    Requests still prefilling are listed in ``prefills`` (rank order) for phase 2.

    Planned ahead (a plan in flight), a request whose pending token is its last (by length)
    has nothing to run, and nobody may be preempted: when not every decode fits, this
    returns False, having changed nothing.
    """
    table, cols, gpu = state.table, state.cols, state.kv.gpu
    bs = state.config.block_size
    ahead = state.ahead
    owner = cols.owner
    start = 0  # position in the running batch where this run of decodes starts
    while True:
        running = table.running
        slots = table.running_slots()
        if start:
            slots = slots[start:]
        if not len(slots):
            return True
        rows = cols.state.take(slots, axis=1)
        computed = rows[COMPUTED]
        prefilling = rows[KNOWN] - computed > 1
        # Planned ahead, the token pending may be its last; in sync none is pending.
        decoding = ~prefilling & (computed < rows[STOP_LEN] - 1) if ahead else ~prefilling
        positions = None  # of the decodes in the batch (from ``start``), when not all of it
        any_prefilling = np.count_nonzero(prefilling)
        if any_prefilling or (ahead and np.count_nonzero(decoding) < len(decoding)):
            positions = decoding.nonzero()[0]
            slots, rows = slots[decoding], rows[:, decoding]
            computed = rows[COMPUTED]
        # Its blocks cover its computed tokens, so it needs one only at a block boundary:
        # the cheap test in bulk, the block table only every block_size steps.
        boundary = (computed % bs == 0).nonzero()[0].tolist()
        need_rows = [row for row in boundary if len(owner[slots[row]].block_ids) * bs <= computed[row]]
        n = len(slots)
        fit = min(n, step.budget)  # decodes of this run: those before the first that does not fit
        available = gpu.num_available
        if len(need_rows) > available:
            fit = min(fit, need_rows[available])
            del need_rows[available:]
        if fit < n:
            if ahead:
                return False
            end = start + (fit if positions is None else int(positions[fit]))  # the first left out
        else:
            end = len(running)
        if any_prefilling:
            prefills += [running[start + i] for i in prefilling.nonzero()[0].tolist() if start + i < end]
        if fit < n:
            slots, rows, computed = slots[:fit], rows[:, :fit], computed[:fit]
            need_rows = [row for row in need_rows if row < fit]
        blocks = gpu.allocate(len(need_rows)) if need_rows else []
        for row, block in zip(need_rows, blocks):
            owner[slots[row]].block_ids.append(block)
        step.add_decodes(slots, computed, rows[GEN], need_rows, blocks)
        if fit == n or not step.budget:
            return True
        # The decode at ``end`` needs a block and none is left: make room, then go on from it.
        if not make_room(state, step, running[end], lambda: gpu.num_available > 0, yields=True):
            return True  # it was the worst-ranked and yielded: nobody after it runs
        start = end


def plan_prompts(
    state: SchedulerState, step: Step, prefills: list[SchedulerRequest], admit_open: bool, now: float
) -> None:
    """Phase 2: prefill chunks of running requests (``prefills``, in rank order) and
    admissions from the waiting queue take the rest of the budget, whichever ranks better
    first. A waiting head that lacks blocks, or whose LoRA adapter finds no free device slot,
    may be stepped over (bounded by the policy: ``max_bypass`` per request,
    :data:`BYPASS_LOOKAHEAD` per iteration), so base-model requests and those of running
    adapters go on; otherwise, or once the gate closes, admissions stop for this iteration."""
    policy, queue = state.policy, state.queue
    skipped: list[SchedulerRequest] = []
    reserved: int | None = None  # blocks the running batch may still claim (at the first admission)
    k = 0
    while step.budget > 0:
        cand = None
        while k < len(prefills):
            cand = prefills[k]
            if cand.status is RUNNING:
                break
            k += 1
            cand = None
        head = queue.peek() if admit_open else None
        if cand is None and head is None:
            break
        if head is None or (cand is not None and cand.rank < head.rank):
            k += 1
            plan_prefill_chunk(state, step, cand)
            continue
        if reserved is None:  # (the prefill chunks before it, ranked ahead, are planned by now)
            reserved = policy.blocks_reserved(state.table.running)
        outcome = try_admit(state, step, head, now, reserved)
        if outcome >= 0:
            reserved += outcome
            for blocked in skipped:  # each admission behind a blocked request counts against it
                blocked.num_bypassed += 1
                if blocked.num_bypassed >= policy.max_bypass:
                    admit_open = False  # bound reached: nobody passes it any more
            continue
        if (
            outcome in (NO_BLOCKS, NO_LORA_SLOT)
            and head.num_bypassed < policy.max_bypass
            and len(skipped) < BYPASS_LOOKAHEAD
        ):
            queue.pop()  # set it aside for this iteration; smaller ones behind it may start
            skipped.append(head)
        else:
            admit_open = False
            policy.batch_formed()  # (static batching: the batch being formed is complete)
    for blocked in skipped:
        queue.push(blocked)


def plan_prefill_chunk(state: SchedulerState, step: Step, req: SchedulerRequest) -> None:
    """Give a running, still-prefilling request its next chunk, cut to the budget and to the
    blocks available, preempting worse-ranked requests only if not one token fits (if none
    ranks below it, it waits, keeping its KV)."""
    kv = state.kv
    want = min(len(req.token_ids) - req.num_computed_tokens, step.budget)
    n = kv.tokens_that_fit(req, want)
    if n < 1:
        if not make_room(state, step, req, lambda: kv.tokens_that_fit(req, want) >= 1, yields=False):
            return
        n = kv.tokens_that_fit(req, want)
    step.add_cached(req, n, kv.grow(req, req.num_computed_tokens + n))
