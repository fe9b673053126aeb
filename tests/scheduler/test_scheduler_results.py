"""Scenario tests of the continuous batcher's side of the plan/result protocol, driven
through a checking FakeWorker: a worker error or a malformed result fails only the requests
it concerns, result rows are matched by slot (any order; a missing or out-of-range slot fails
only its request), the protocol's misuse raises, and the bookkeeping (timing fields, stats,
finished requests forgotten, AddRequest messages taken directly).

Every call goes through the Harness, which checks the scheduler's and the pool's
invariants (free + held == total among them) after it; every scenario ends with
``h.run()``, which steps until idle and asserts that every block is free again.
"""

from __future__ import annotations

import msgspec
import pytest

from conveyor.ipc.messages import AddRequest, FinishReason, SamplingParams, SchedulerStats, StepResult
from conveyor.scheduler.scheduler import Scheduler
from tests.scheduler.scenario_helpers import assert_alone_tokens, cfg, ids
from tests.scheduler.scheduler_harness import EOS, Harness

# ---------------------------------------------------------------- worker error


def test_worker_error_fails_the_plans_requests_only():
    h = Harness(cfg(max_num_seqs=2), worker_kwargs={"fail_steps": {2}})
    for rid in "abc":
        h.add(rid, max_tokens=5)
    h.step()
    plan = h.schedule()
    outs = h.finish_step(plan)
    assert {o.request_id for o in outs} == {"a", "b"}
    for o in outs:
        assert o.finish_reason == FinishReason.ERROR and "injected failure" in o.error
        assert o.new_token_ids == []
    assert h.scheduler.state.kv.gpu.num_held == 0
    assert h.scheduler.num_waiting == 1
    plan = h.step()
    assert sorted(h.finished_ids(plan)) == ["a", "b"] and ids(plan.new_requests) == ["c"]
    h.run()
    assert h.final["c"].finish_reason == FinishReason.LENGTH
    assert_alone_tokens(h, "a", "b", "c")


def test_malformed_result_is_treated_as_an_error():
    h = Harness(cfg())
    h.add("a")
    plan = h.schedule()
    good = h.worker.execute(plan)
    (out,) = h.finish_step(plan, StepResult(plan.step_id, good.slots, []))
    assert out.finish_reason == FinishReason.ERROR and "malformed" in out.error
    h.add("b")
    h.step()  # tells the worker to drop "a"
    h.run()


def test_result_rows_in_another_order_are_matched_by_slot():
    """Each row of a result is matched by its slot: a result listing the rows in another
    order than the plan's gives the same outputs."""
    h = Harness(cfg())
    for rid in "abc":
        h.add(rid, max_tokens=6)
    h.step()
    h.step()  # all three decoding, past their first token
    plan = h.schedule()
    assert len(plan.cached_requests) == 3 and not plan.new_requests
    good = h.worker.execute(plan)
    shuffled = StepResult(plan.step_id, good.slots[::-1], good.sampled_token_ids[::-1])
    outs = {o.request_id: o.new_token_ids for o in h.finish_step(plan, shuffled)}
    assert outs == {h.cached_ids(plan)[i]: [t] for i, t in enumerate(good.sampled_token_ids)}
    h.run()
    assert_alone_tokens(h, *"abc")


def test_missing_token_fails_that_request():
    h = Harness(cfg())
    h.add("a")
    h.add("b")
    plan = h.schedule()
    good = h.worker.execute(plan)
    i = good.slots.index(plan.new_requests[0].slot)
    assert plan.new_requests[0].request_id == "a"
    result = StepResult(plan.step_id, good.slots[i + 1 :], good.sampled_token_ids[i + 1 :])
    outs = {o.request_id: o for o in h.finish_step(plan, result)}
    assert outs["a"].finish_reason == FinishReason.ERROR and outs["b"].finish_reason is None
    # The output is the request's own: its text names no id (the frontend's ids are internal).
    assert outs["a"].error.startswith("worker sampled no token for this request") and "'a'" not in outs["a"].error
    h.run()


def test_result_rows_naming_no_slot_are_ignored():
    """A row whose slot is outside ``0 .. max_num_seqs - 1`` answers nobody (a negative one
    is not read from the end): the request due that token fails alone, the others get theirs."""
    for past_the_end in (False, True):
        h = Harness(cfg(max_num_seqs=4))
        h.add("a")
        h.add("b")
        plan = h.schedule()
        good = h.worker.execute(plan)
        a_slot, b_slot = (d.slot for d in plan.new_requests)
        token = dict(zip(good.slots, good.sampled_token_ids))
        assert token[a_slot] != token[b_slot]
        bad_slot = 4 if past_the_end else b_slot - 4  # (read from the end, -4 + b_slot is b's)
        result = StepResult(plan.step_id, [b_slot, bad_slot], [token[b_slot], token[a_slot]])
        outs = {o.request_id: o for o in h.finish_step(plan, result)}
        assert outs["a"].finish_reason == FinishReason.ERROR, bad_slot
        assert outs["a"].error.startswith("worker sampled no token"), outs["a"].error
        assert outs["b"].finish_reason is None and outs["b"].new_token_ids == [token[b_slot]]
        h.run()


# ---------------------------------------------------------------- bookkeeping


def test_timing_fields_are_set_once():
    h = Harness(cfg())
    h.add("a", max_tokens=4)
    h.run()
    outs = h.outputs["a"]
    # The first token and the final output carry the timing; tokens between travel as columns.
    assert outs[1].scheduled_time is None and outs[2].scheduled_time is None
    outs = [outs[0], outs[-1]]
    sched = {o.scheduled_time for o in outs}
    first = {o.first_token_time for o in outs}
    assert len(sched) == 1 and len(first) == 1
    (s,), (f,) = sched, first
    assert s is not None and f is not None and s <= f


def test_stats_match_scheduler_stats_fields():
    h = Harness(cfg(max_num_seqs=1))
    h.add("a", max_tokens=2)
    h.add("b", max_tokens=2)
    h.step()
    stats = h.scheduler.stats()
    fields = {f.name for f in msgspec.structs.fields(SchedulerStats)} - {"query_id"}
    assert set(stats) == fields
    assert stats["num_running"] == 1 and stats["num_waiting"] == 1 and stats["num_steps"] == 1
    assert stats["free_blocks"] + stats["held_blocks"] == stats["total_blocks"] == 64
    SchedulerStats(query_id="q", **stats)
    h.run()


def test_protocol_misuse_raises():
    h = Harness(cfg())
    h.add("a")
    plan = h.schedule()
    ahead = h.schedule()  # planned ahead: the decode of the token plan 1 samples
    assert ahead is not None and h.cached_ids(ahead) == ["a"]
    with pytest.raises(RuntimeError):
        h.scheduler.schedule()  # a third plan in flight
    with pytest.raises(ValueError):
        h.scheduler.update(ahead, StepResult(ahead.step_id, [], []))  # not the oldest
    with pytest.raises(ValueError):
        h.scheduler.update(plan, StepResult(plan.step_id + 1, [], []))
    h.finish_step(plan)
    with pytest.raises(ValueError):
        h.scheduler.update(plan, StepResult(plan.step_id, [], []))
    h.finish_step(ahead)
    h.run()


def test_finished_requests_are_forgotten():
    h = Harness(cfg(max_num_seqs=4))
    for i in range(50):
        h.add(f"r{i}", prompt_len=3, max_tokens=2)
    h.run()
    assert len(h.final) == 50
    assert not h.scheduler.state.table.live and not h.scheduler.state.table.running


def test_scheduler_accepts_add_request_messages_directly():
    sched = Scheduler(cfg(), eos_token_ids=[EOS], vocab_size=None)
    assert sched.add_request(AddRequest("x", [3, 4], SamplingParams(max_tokens=1), 0.0)) is None
    plan = sched.schedule()
    assert plan.new_requests[0].token_ids == [3, 4]
