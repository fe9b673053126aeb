"""Scenario tests of the continuous batcher's slots, driven through a checking FakeWorker:
a slot freed by a finished, preempted or aborted request goes to the next admission in the
plan that drops it (after any plan ahead that still names it), check_invariants catches
slot bookkeeping errors, and max_num_seqs is bounded by the slots a worker accepts.

Every call goes through the Harness, which checks the scheduler's and the pool's
invariants (free + held == total among them) after it; every scenario ends with
``h.run()``, which steps until idle and asserts that every block is free again.
"""

from __future__ import annotations

import pytest

from conveyor.ipc.messages import MAX_SLOTS
from conveyor.scheduler.request import RequestStatus
from conveyor.scheduler.scheduler import Scheduler
from tests.scheduler.scenario_helpers import assert_alone_tokens, cfg
from tests.scheduler.scheduler_harness import EOS, Harness

# ---------------------------------------------------------------- slots


def test_slot_of_a_finished_request_goes_to_the_next_admission_in_the_plan_that_drops_it():
    h = Harness(cfg(max_num_seqs=2))
    h.add("a", prompt_len=4, max_tokens=1)
    h.add("b", prompt_len=4, max_tokens=5)
    h.add("c", prompt_len=4, max_tokens=2)
    first = h.step()
    slot_of = {r.request_id: r.slot for r in first.new_requests}
    assert sorted(slot_of.values()) == [0, 1] and "a" in h.final  # a finished with its first token
    plan = h.step()
    # The worker drops a's slot, then takes c in on it; b keeps its slot.
    assert plan.finished_slots == [slot_of["a"]] and h.finished_ids(plan) == ["a"]
    assert [(r.request_id, r.slot) for r in plan.new_requests] == [("c", slot_of["a"])]
    assert list(plan.cached_requests.slots) == [slot_of["b"]]
    h.run()
    assert_alone_tokens(h, "a", "b", "c")


def test_slot_of_a_preempted_request_goes_to_the_request_that_preempted_it():
    h = Harness(cfg(policy="priority", aging_rate=0.0, max_num_seqs=2, preemption="recompute"))
    h.add("low", prompt_len=3, max_tokens=20, priority=0)
    h.add("mid", prompt_len=3, max_tokens=20, priority=1)
    h.step()
    low = h.scheduler.get_request("low")
    low_slot = low.slot
    h.add("vip", prompt_len=3, max_tokens=2, priority=9)
    plan = h.step()
    assert plan.finished_slots == [low_slot]
    assert [(r.request_id, r.slot) for r in plan.new_requests] == [("vip", low_slot)]
    assert low.slot == -1 and low.status is RequestStatus.PREEMPTED
    assert low_slot not in list(plan.cached_requests.slots)  # taken out of the plan's rows
    h.run()
    h.check_outcomes()
    resumed = [r for p in h.plans for r in p.new_requests if r.request_id == "low"]
    assert len(resumed) == 2  # came back as a new request, on whatever slot was free


def test_slot_freed_while_a_plan_ahead_still_names_it_is_reused_after_that_plan():
    """With overlap, a request ending at step N is still in plan N+1 (formed ahead): its slot
    is dropped and reused by N+2, and N+1's token for it, on that slot, is discarded."""
    h = Harness(cfg(max_num_seqs=1), worker_kwargs={"eos_at": {"a": 4 + 1}}, overlap=True)
    h.add("a", prompt_len=4, max_tokens=10)
    h.add("b", prompt_len=4, max_tokens=3)
    plans = []
    while "b" not in h.final:
        plans.append(h.step())
    (a_slot,) = {r.slot for p in plans for r in p.new_requests if r.request_id == "a"}
    ended = next(p for p in plans if "a" in h.cached_ids(p) and p.planned_ahead)  # the decode after a's EOS
    reuse = next(p for p in plans if any(r.request_id == "b" for r in p.new_requests))
    assert reuse.step_id > ended.step_id
    assert list(reuse.finished_slots) == [a_slot] and reuse.new_requests[0].slot == a_slot
    assert h.tokens["a"][-1] == EOS and len(h.tokens["a"]) == 2  # nothing from the plan ahead
    h.run()
    h.check_outcomes()


def test_abort_frees_the_slot_for_the_next_plan():
    h = Harness(cfg(max_num_seqs=1))
    h.add("a", max_tokens=10)
    h.add("b", max_tokens=2)
    plan = h.step()
    slot = plan.new_requests[0].slot
    h.abort("a")
    plan = h.step()
    assert list(plan.finished_slots) == [slot] and [(r.request_id, r.slot) for r in plan.new_requests] == [("b", slot)]
    h.run()


def test_check_invariants_catches_slot_bookkeeping_errors():
    def running_pair() -> Harness:
        h = Harness(cfg(max_num_seqs=3))
        h.add("a", max_tokens=10)
        h.add("b", max_tokens=10)
        h.step()
        return h

    h = running_pair()
    a, b = h.scheduler.get_request("a"), h.scheduler.get_request("b")
    b.slot = a.slot
    with pytest.raises(AssertionError, match="share a slot"):
        h.scheduler.check_invariants()

    h = running_pair()
    h.scheduler.state.free_slots.pop()  # a slot lost: neither free nor held
    with pytest.raises(AssertionError, match="lost"):
        h.scheduler.check_invariants()

    h = running_pair()
    h.scheduler.state.free_slots.append(h.scheduler.get_request("a").slot)
    with pytest.raises(AssertionError, match="free twice|both held and free"):
        h.scheduler.check_invariants()

    h = running_pair()
    h.scheduler.state.finished_slots.append(h.scheduler.get_request("b").slot)  # dropped while held
    with pytest.raises(AssertionError, match="queued to be dropped but held"):
        h.scheduler.check_invariants()

    h = running_pair()
    plan = h.schedule()  # in flight, naming a and b by their slots
    a, b = h.scheduler.get_request("a"), h.scheduler.get_request("b")
    a.slot, b.slot = b.slot, a.slot  # still distinct, but not what the plan in flight says
    with pytest.raises(AssertionError, match="names it"):
        h.scheduler.check_invariants()
    assert plan is not None

    h = Harness(cfg())
    h.add("w")
    h.scheduler.get_request("w").slot = 5  # waiting with a slot
    with pytest.raises(AssertionError, match="waits holding a slot"):
        h.scheduler.check_invariants()


def test_max_num_seqs_is_bounded_by_the_slots_a_worker_accepts():
    with pytest.raises(ValueError, match="slots"):
        Scheduler(cfg(max_num_seqs=MAX_SLOTS + 1), [EOS])
