"""The scheduler's invariants, asserted (for tests: O(all live requests + blocks)).

What :class:`~conveyor.scheduler.scheduler.Scheduler` keeps true between calls (its class
docstring lists them): every live request is running or waiting, never both; block
reference counts match the block tables and step holds, on the GPU and in the swap space;
the prefix index holds exactly the registered ids; a parallel-sampling request's held sequences
hold nothing and are live but neither queued nor running; slots are held by running requests
only, each once, and every request still running in a plan in flight has the slot that
plan names it by; the slot columns mirror the running requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.scheduler.policy import blocks_for
from conveyor.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from conveyor.scheduler.state import SchedulerState

RUNNING = RequestStatus.RUNNING
SWAPPED = RequestStatus.SWAPPED


def live_seqs_of(group) -> list:
    return [r for r in group.seqs if r.status is not RequestStatus.FINISHED]


def check_invariants(state: SchedulerState) -> None:
    """Assert every invariant of the module docstring."""
    cfg = state.config
    bs = cfg.block_size
    running = state.table.running
    waiting = list(state.queue)
    running_ids = [r.request_id for r in running]
    waiting_ids = [r.request_id for r in waiting]
    assert len(set(running_ids)) == len(running_ids), "a request is running twice"
    assert len(set(waiting_ids)) == len(waiting_ids), "a request is queued twice"
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    held = [r for g in state.forking for r in g.held]
    for r in held:  # sequences of a parallel-sampling request waiting for its leader's prompt KV
        assert r.status is RequestStatus.WAITING and r.slot == -1 and not r.block_ids and not r.cpu_blocks
        assert r.group is not None and state.groups[r.group.request_id] is r.group
    assert not {r.request_id for r in held} & (set(running_ids) | set(waiting_ids)), "a held sequence is queued"
    live_seqs = [r for g in state.groups.values() for r in g.seqs if r.status is not RequestStatus.FINISHED]
    assert all(len(live_seqs_of(g)) == g.num_live > 0 for g in state.groups.values()), "a group's live count is off"
    assert all(state.table.live.get(r.request_id) is r for r in live_seqs), "a live sequence is not live"
    assert set(running_ids) | set(waiting_ids) | {r.request_id for r in held} == set(state.table.live), (
        "live map out of sync"
    )
    assert len(running) <= cfg.max_num_seqs
    assert all(a.rank < b.rank for a, b in zip(running, running[1:])), "running batch out of rank order"
    gpu_refs: dict[int, int] = {}
    cpu_refs: dict[int, int] = {}
    for r in running:
        assert r.status is RUNNING and state.table.live[r.request_id] is r
        assert r.slot >= 0 and not r.cpu_blocks, f"{r.request_id}: running without a slot, or with CPU blocks"
        assert len(r.block_ids) * bs >= r.num_computed_tokens
        pending = max(0, r.num_computed_tokens + 1 - r.num_tokens)
        # (a speculative decode in flight computes up to 1 + k tokens, and keeps blocks for k
        # tokens beyond its known ones: scheduler/speculation.py)
        spec = cfg.speculative_tokens
        assert pending <= len(state.inflight) * (1 + spec), (
            f"{r.request_id}: {pending} tokens pending, or nothing to run"
        )
        assert len(r.block_ids) <= blocks_for(r.num_tokens + pending + spec, bs)
        assert state.done_tokens(r) <= r.num_tokens, f"{r.request_id}: KV of unknown tokens counted as done"
        assert len(set(r.block_ids)) == len(r.block_ids) and min(r.block_ids, default=0) >= 0
        for i in range(r.num_registered_blocks):
            h = state.kv.gpu.block_hash(r.block_ids[i])
            assert h is None or h == r.block_hashes[i], f"{r.request_id}: block {i} holds another prefix"
    for r in waiting:
        assert state.table.live[r.request_id] is r and r.slot == -1, f"{r.request_id} waits holding a slot"
        if r.status is SWAPPED:
            assert r.cpu_blocks, f"swapped {r.request_id} holds no KV"
            assert len(r.block_ids) == len(r.cpu_blocks) == blocks_for(r.num_computed_tokens, bs)
            assert all(b == -1 for b in r.block_ids) and [i for i, _ in r.cpu_blocks] == list(range(len(r.block_ids)))
            for _, c in r.cpu_blocks:
                cpu_refs[c] = cpu_refs.get(c, 0) + 1
        else:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not r.block_ids and r.num_computed_tokens == 0 and not r.cpu_blocks
    for r in running + waiting:
        for b in r.block_ids:
            if b >= 0:
                gpu_refs[b] = gpu_refs.get(b, 0) + 1
    state.kv.gpu.check_invariants(gpu_refs)
    swap = state.kv.swap
    registered = state.kv.gpu.registered_ids()
    if swap.pool is not None:
        for c in swap.holds():
            cpu_refs[c] = cpu_refs.get(c, 0) + 1
        swap.pool.check_invariants(cpu_refs)
        registered += swap.pool.registered_ids()
    held_ids: dict[int, int] = {}
    for content in registered:
        held_ids[content] = held_ids.get(content, 0) + 1
    state.kv.index.check(held_ids)
    for r in running:
        assert len(r.block_hashes) == r.num_registered_blocks <= r.num_computed_tokens // bs, r.request_id
    assert swap.num_held_by_requests == sum(len(r.cpu_blocks) for r in waiting)
    check_slots(state)
    state.cols.check(running)
    assert state.table.running_slots().tolist() == [r.slot for r in running], "cached running slots are stale"


def check_slots(state: SchedulerState) -> None:
    """The slot invariants (the scheduler's docstrings), and that every request still running
    in a plan in flight has the slot that plan names it by, and the slot generation its
    sampling row was noted with (what applying the result relies on)."""
    n = state.config.max_num_seqs
    held = [r.slot for r in state.table.running]
    free = state.free_slots
    assert len(set(held)) == len(held), f"two running requests share a slot: {sorted(held)}"
    assert len(set(free)) == len(free), f"a slot is free twice: {sorted(free)}"
    assert not set(held) & set(free), f"slots both held and free: {sorted(set(held) & set(free))}"
    assert set(held) | set(free) == set(range(n)), "slots lost or out of range"
    # Slots given back since the last plan: no plan formed since could hand them out again.
    pending = state.finished_slots
    assert len(set(pending)) == len(pending), f"a slot is queued to be dropped twice: {pending}"
    assert set(pending) <= set(free), f"slots queued to be dropped but held: {sorted(set(pending) - set(free))}"
    for entry in state.inflight:
        plan, step = entry.plan, entry.step
        new_slots = [d.slot for d in plan.new_requests]
        cached_slots = list(plan.cached_requests.slots)
        named = new_slots + cached_slots
        assert len(set(named)) == len(named), f"step {plan.step_id} names a slot twice"
        assert not set(cached_slots) & set(plan.finished_slots), f"step {plan.step_id} drops a slot it runs"
        slot_of_new = {d.request_id: d.slot for d in plan.new_requests}
        rows = iter(cached_slots)
        expected = [(r, next(rows)) for r in step.decodes]
        for r, _ in step.scheduled:
            expected.append((r, slot_of_new[r.request_id] if r.request_id in slot_of_new else next(rows)))
        assert next(rows, None) is None, f"step {plan.step_id}: more cached rows than requests"
        for r, slot in expected:
            if r.status is RUNNING:
                assert r.slot == slot, f"{r.request_id} holds slot {r.slot}, step {plan.step_id} names it {slot}"
        # The rows that sample: every decode but a pooling request's last prompt token (it is
        # pooled), and other rows, each once; a row whose slot still has the generation it was
        # planned with names a running request of this plan.
        sampling = step.sample_slots.tolist()
        assert len(set(sampling)) == len(sampling), f"step {plan.step_id} samples a slot twice"
        pooled = {s for s in step.dslots.tolist() if step.owner(s).sampling.pooling}
        assert set(step.dslots.tolist()) - pooled <= set(sampling), f"step {plan.step_id}: a decode does not sample"
        assert not pooled & set(sampling), f"step {plan.step_id}: a pooling request samples"
        # The worker answers in plan order: new requests that sample, then cached rows that do.
        sampling_set = set(sampling)
        answer_order = [d.slot for d in plan.new_requests if d.slot in sampling_set]
        answer_order += [slot for slot in cached_slots if slot in sampling_set]
        assert step.answer_slots.tolist() == answer_order, f"step {plan.step_id}: answer order is not plan order"
        answer = step.answer_slots if step.answer_rows is None else step.answer_slots[step.answer_rows]
        assert answer.tolist() == sampling, f"step {plan.step_id}: the worker's answer order is mapped wrong"
        planned = {id(r) for r in step.decodes} | {id(r) for r, _ in step.scheduled}
        cols = state.cols
        for slot, gen in zip(step.sample_slots.tolist(), step.sample_gens.tolist()):
            if cols.generation(slot) == gen:
                owner = cols.owner[slot]
                assert owner is not None and owner.status is RUNNING and id(owner) in planned, (
                    f"step {plan.step_id}: slot {slot} of generation {gen} is held by another request"
                )
