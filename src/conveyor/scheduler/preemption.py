"""Preemption: the one place where running requests give up their KV for others.

Three rules of the scheduler may need room: a decode at a block boundary (phase 1), a
prefill chunk that not one token of fits (phase 2), and, under the priority policy, a
waiting request that lacks a slot or blocks. Each states what it needs as a test and calls
:func:`make_room`; who yields is the policy's call
(:meth:`~conveyor.scheduler.policy.SchedulingPolicy.choose_victim`), and what yielding means
(swap out or drop the KV, requeue under the old rank) is :func:`preempt`.

Only a plan formed with nothing in flight preempts: a request's token sampled by a plan in
flight would be lost with its KV. A plan planned ahead that would have to preempt stops
there instead and says so (``SchedulerState.declined``), so the caller forms the next plan in
sync (see the scheduler's docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from conveyor.runtime.config import Preemption
from conveyor.scheduler.request import RequestStatus, SchedulerRequest
from conveyor.scheduler.step import Step

if TYPE_CHECKING:
    from conveyor.scheduler.state import SchedulerState


def make_room(
    state: SchedulerState, step: Step, req: SchedulerRequest, fits: Callable[[], bool], *, yields: bool
) -> bool:
    """Preempt running requests, as the policy chooses them, until ``fits()``; whether it does.

    False when nobody ranks below ``req`` (with ``yields``, ``req`` itself was then preempted)
    or when the plan is planned ahead and would have to preempt (``state.declined`` is set).
    """
    running = state.table.running
    choose_victim = state.policy.choose_victim
    while not fits():
        victim = choose_victim(running, req, yields)
        if victim is None:
            return False
        if state.ahead:
            state.declined = True
            return False
        preempt(state, step, victim)
        if victim is req:
            return False
    return True


def preempt(state: SchedulerState, step: Step, req: SchedulerRequest) -> None:
    """Swap out or drop ``req``'s KV and requeue it under its rank (it is running; only a
    plan formed in sync preempts, so no token of it is pending)."""
    assert req.num_computed_tokens < len(req.token_ids), f"{req.request_id} preempted with tokens pending"
    state.table.stop_running(req)
    step.unschedule(req)
    kv = state.kv
    mode = state.policy.preemption_mode(kv.blocks_to_swap(req), req.num_computed_tokens, kv.swap.num_available)
    if req.sampling.pooling:  # the worker's running pool of its chunks goes with its slot: start over
        mode = Preemption.RECOMPUTE
    if mode is Preemption.SWAP:
        kv.swap_out(req)
        req.status = RequestStatus.SWAPPED
        step.num_swap += 1
        step.swapped_out.append(req)
    else:
        drop_kv(state, req)
        step.num_recompute += 1
    state.num_preemptions[mode] += 1
    state.release_slot(req)  # after it left the plan's rows (unschedule above)
    step.preempted.add(id(req))
    state.queue.push(req)


def drop_kv(state: SchedulerState, req: SchedulerRequest) -> None:
    """Give back ``req``'s KV (GPU and swapped) for a recompute from the start: it waits as
    PREEMPTED, holding nothing (a victim, or a swapped victim whose copies failed)."""
    state.kv.free(req)
    req.num_computed_tokens = 0
    req.num_registered_blocks = 0
    req.block_hashes = []
    req.status = RequestStatus.PREEMPTED
