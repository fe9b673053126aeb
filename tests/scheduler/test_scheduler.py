"""Scenario tests of the continuous batcher, driven through a checking FakeWorker.

Every call goes through the Harness, which checks the scheduler's and the pool's
invariants (free + held == total among them) after it; every scenario ends with
``h.run()``, which steps until idle and asserts that every block is free again.
"""

from __future__ import annotations

import msgspec
import pytest
from tests.scheduler.fake_worker import default_token
from tests.scheduler.scheduler_harness import EOS, Harness

from conveyor.runtime.config import SchedulerConfig
from conveyor.ipc.messages import (
    MAX_SLOTS,
    AddRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
    StepResult,
    int_list,
)
from conveyor.scheduler.request import SchedulerRequest, RequestStatus
from conveyor.scheduler.results import stop_reason
from conveyor.scheduler.scheduler import Scheduler


def cfg(**overrides) -> SchedulerConfig:
    base = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    base.update(overrides)
    return SchedulerConfig(**base)


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def assert_alone_tokens(h: Harness, *rids: str) -> None:
    """Each request produced exactly the tokens it would have produced running alone."""
    for rid in rids:
        got = h.tokens[rid]
        assert got == h.expected_tokens(rid, len(got)), rid


# ---------------------------------------------------------------- admission


def test_admission_respects_max_num_seqs():
    h = Harness(cfg(max_num_seqs=2))
    for i in range(4):
        h.add(f"r{i}", prompt_len=4, max_tokens=3)
    plan = h.step()
    assert ids(plan.new_requests) == ["r0", "r1"] and not plan.cached_requests
    assert h.scheduler.num_running == 2 and h.scheduler.num_waiting == 2
    h.step()
    plan = h.step()
    assert h.cached_ids(plan) == ["r0", "r1"] and not plan.new_requests
    assert h.final["r0"].finish_reason == h.final["r1"].finish_reason == FinishReason.LENGTH
    plan = h.step()
    assert ids(plan.new_requests) == ["r2", "r3"]
    assert h.finished_ids(plan) == ["r0", "r1"]
    h.run()
    assert_alone_tokens(h, "r0", "r1", "r2", "r3")
    assert all(len(h.tokens[f"r{i}"]) == 3 for i in range(4))


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    h = Harness(cfg(max_num_batched_tokens=10))
    for rid in "abc":
        h.add(rid, prompt_len=4, max_tokens=2)
    plan = h.step()
    assert h.scheduled_in(plan) == {"a": 4, "b": 4, "c": 2}
    assert [r.num_computed_tokens for r in plan.new_requests] == [0, 0, 0]
    assert len(plan.new_requests[2].token_ids) == 4  # all tokens travel, only 2 are run
    assert set(h.tokens) == {"a", "b"}  # c's prompt is unfinished: no token yet
    plan = h.step()
    assert h.scheduled_in(plan) == {"a": 1, "b": 1, "c": 2}
    assert h.cached_rows(plan)["c"].num_computed_tokens == 2
    assert h.final["a"].finish_reason == FinishReason.LENGTH and len(h.tokens["c"]) == 1
    h.run()
    assert_alone_tokens(h, "a", "b", "c")


def test_waiting_head_that_lacks_blocks_is_not_skipped_without_bypass():
    h = Harness(cfg(block_size=4, num_blocks=5, max_bypass=0))
    for rid in "abc":
        h.add(rid, prompt_len=8, max_tokens=1)  # 2 blocks each
    h.add("d", prompt_len=1, max_tokens=1)  # would fit in the last free block
    plan = h.step()
    assert ids(plan.new_requests) == ["a", "b"]
    assert h.scheduler.num_waiting == 2
    # a and b finished in that same iteration: their blocks are already back.
    assert h.final["a"].finish_reason == FinishReason.LENGTH
    assert h.scheduler.state.kv.gpu.num_held == 0
    assert h.scheduler.get_request("a") is None
    plan = h.step()
    assert ids(plan.new_requests) == ["c", "d"]
    assert h.finished_ids(plan) == ["a", "b"]
    h.run()


def test_retired_request_frees_blocks_in_the_same_iteration():
    h = Harness(cfg(block_size=4, num_blocks=8))
    h.add("a", prompt_len=6, max_tokens=2)
    h.add("b", prompt_len=6, max_tokens=5)
    h.step()
    held_before = h.scheduler.state.kv.gpu.num_held
    a_blocks = 2
    plan = h.schedule()
    outs = h.finish_step(plan)
    assert [o.finish_reason for o in outs] == [FinishReason.LENGTH, None]
    assert h.scheduler.state.kv.gpu.num_held == held_before - a_blocks
    assert h.scheduler.num_running == 1
    plan = h.step()
    assert h.finished_ids(plan) == ["a"] and h.cached_ids(plan) == ["b"]
    h.run()


# ---------------------------------------------------------------- chunked prefill


def test_long_prompt_is_chunked_while_decodes_run_every_iteration():
    h = Harness(cfg(max_num_batched_tokens=8, block_size=4, num_blocks=64))
    assert h.chunks_beside_decodes(prompt_len=30, decode_tokens=20) == [6, 6, 6, 6, 6]
    first, *rest = [p for p in h.plans if "long" in h.scheduled_in(p)]
    (new,) = [r for r in first.new_requests if r.request_id == "long"]
    assert len(new.token_ids) == 30 and len(new.block_ids) == 2  # covers the 6-token chunk
    for i, plan in enumerate(rest, start=1):
        assert h.cached_rows(plan)["long"].num_computed_tokens == 6 * i
    h.run()
    assert_alone_tokens(h, "d0", "d1", "long")


# ---------------------------------------------------------------- stop conditions


def test_eos_stops():
    h = Harness(cfg(), worker_kwargs={"eos_at": {"r": 4 + 2}})
    h.add("r", prompt_len=4, max_tokens=10)
    h.run()
    assert h.final["r"].finish_reason == FinishReason.STOP
    assert len(h.tokens["r"]) == 3 and h.tokens["r"][-1] == EOS


def test_ignore_eos_runs_to_max_tokens():
    h = Harness(cfg(), worker_kwargs={"eos_at": {"r": 4 + 2}})
    h.add("r", prompt_len=4, max_tokens=5, ignore_eos=True)
    h.run()
    assert h.final["r"].finish_reason == FinishReason.LENGTH
    assert len(h.tokens["r"]) == 5 and h.tokens["r"][2] == EOS


def test_stop_token_id_stops():
    def token_fn(rid: str, pos: int) -> int:
        return 777 if pos == 4 + 1 else default_token(rid, pos)

    h = Harness(cfg(), worker_kwargs={"token_fn": token_fn})
    h.add("r", prompt_len=4, max_tokens=10, stop_token_ids=[777])
    h.add("other", prompt_len=4, max_tokens=3)  # 777 is not a stop token for this one
    h.run()
    assert h.final["r"].finish_reason == FinishReason.STOP and h.tokens["r"][-1] == 777
    assert len(h.tokens["r"]) == 2
    assert h.final["other"].finish_reason == FinishReason.LENGTH and h.tokens["other"][1] == 777


def test_decode_columns_apply_each_requests_own_stop_rules():
    """The decode step applies tokens in bulk (scheduler/slot_columns.py): a model with two
    EOS ids, a request ignoring them and one with stop ids of its own must each stop by their
    own rules, and every plain token must reach the output columns in order."""
    sched = Scheduler(cfg(), eos_token_ids=[5, 9], vocab_size=None)
    script = {
        "eos2": [1, 2, 9, 3], "ignore": [9, 5, 9, 9], "own": [3, 4, 77, 2], "own_only": [3, 5, 9, 77, 2],
        "long": [6, 7, 8, 6, 7],
    }
    sched.add_request(AddRequest("eos2", [11, 12], SamplingParams(max_tokens=8), 0.0))
    sched.add_request(AddRequest("ignore", [11, 13], SamplingParams(max_tokens=4, ignore_eos=True), 0.0))
    sched.add_request(AddRequest("own", [11, 14], SamplingParams(max_tokens=8, stop_token_ids=[77]), 0.0))
    own_only = SamplingParams(max_tokens=8, stop_token_ids=[77], ignore_eos=True)
    sched.add_request(AddRequest("own_only", [11, 16], own_only, 0.0))
    sched.add_request(AddRequest("long", [11, 15], SamplingParams(max_tokens=5, ignore_eos=True), 0.0))
    on_slot: dict[int, str] = {}
    sampled: dict[str, int] = {}
    streamed: dict[str, list[int]] = {rid: [] for rid in script}
    finals: dict[str, RequestOutput] = {}
    while (plan := sched.schedule()) is not None:
        for slot in int_list(plan.finished_slots):
            on_slot.pop(slot, None)
        for new in plan.new_requests:
            on_slot[new.slot] = new.request_id
        slots = [new.slot for new in plan.new_requests] + int_list(plan.cached_requests.slots)
        tokens = []
        for slot in slots:  # every prompt fits one step: every row samples
            rid = on_slot[slot]
            tokens.append(script[rid][sampled.get(rid, 0)])
            sampled[rid] = sampled.get(rid, 0) + 1
        out = sched.update(plan, StepResult(plan.step_id, slots, tokens))
        for rid, token in zip(out.request_ids, out.token_ids):
            streamed[rid].append(token)
        for o in out.outputs:
            streamed[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finals[o.request_id] = o
        sched.check_invariants()
    assert streamed == {
        "eos2": [1, 2, 9], "ignore": [9, 5, 9, 9], "own": [3, 4, 77], "own_only": [3, 5, 9, 77], "long": [6, 7, 8, 6, 7],
    }
    stop, length = FinishReason.STOP, FinishReason.LENGTH
    assert {rid: o.finish_reason for rid, o in finals.items()} == {
        "eos2": stop, "ignore": length, "own": stop, "own_only": stop, "long": length,
    }


def test_max_tokens_gives_length_and_eos_takes_precedence():
    h = Harness(cfg(), worker_kwargs={"eos_at": {"eos_last": 4 + 2}})
    h.add("plain", prompt_len=4, max_tokens=3)
    h.add("eos_last", prompt_len=4, max_tokens=3)
    h.run()
    assert h.final["plain"].finish_reason == FinishReason.LENGTH and len(h.tokens["plain"]) == 3
    assert h.final["eos_last"].finish_reason == FinishReason.STOP and len(h.tokens["eos_last"]) == 3


def test_request_filling_max_model_len_ends_with_length():
    h = Harness(cfg(max_model_len=12))
    h.add("r", prompt_len=8, max_tokens=4)
    h.run()
    assert h.final["r"].finish_reason == FinishReason.LENGTH and len(h.tokens["r"]) == 4


def test_model_length_stop_is_checked_after_max_tokens():
    # Unreachable through add_request (prompt + max_tokens <= max_model_len is enforced
    # there), so check the defensive condition on the stop check itself.
    req = SchedulerRequest.from_message(AddRequest("r", [1] * 7, SamplingParams(max_tokens=100), 0.0), frozenset([EOS]), 8)
    req.token_ids.append(5)
    assert stop_reason(req, 5) == FinishReason.LENGTH
    req = SchedulerRequest.from_message(AddRequest("r", [1] * 6, SamplingParams(max_tokens=100), 0.0), frozenset([EOS]), 8)
    req.token_ids.append(5)
    assert stop_reason(req, 5) is None


# ---------------------------------------------------------------- preemption


def test_preemption_evicts_the_newest_and_requeues_it_first():
    h = Harness(cfg(block_size=2, num_blocks=6, max_num_seqs=3, max_bypass=0))
    for rid in "ABC":
        h.add(rid, prompt_len=2, max_tokens=6)  # 8 tokens = 4 blocks at most
    h.add("D", prompt_len=2, max_tokens=2)
    preempt_plan = None
    while preempt_plan is None:
        plan = h.step()
        if h.finished_ids(plan):
            preempt_plan = plan
    assert h.finished_ids(preempt_plan) == ["C"]
    assert "C" not in h.scheduled_in(preempt_plan)
    assert h.scheduler.stats()["num_preemptions"] == 1
    c = h.scheduler.get_request("C")
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and not c.block_ids
    assert ids(sorted(h.scheduler.state.queue, key=lambda r: r.rank)) == ["C", "D"]  # C ahead of the later arrival D
    outputs_before = len(h.tokens["C"])
    assert outputs_before > 0
    h.run()
    # C came back with all its tokens, recomputed from scratch.
    resumes = [r for p in h.plans for r in p.new_requests if r.request_id == "C"]
    assert len(resumes) >= 2
    resumed = resumes[1]
    assert resumed.num_computed_tokens == 0
    assert resumed.token_ids == h.prompts["C"] + h.tokens["C"][:outputs_before]
    admitted = [r.request_id for p in h.plans for r in p.new_requests]
    assert admitted.index("D") > len(admitted) - 1 - admitted[::-1].index("C")  # D after C's resume
    for rid in "ABCD":
        assert h.final[rid].finish_reason == FinishReason.LENGTH
    assert_alone_tokens(h, *"ABCD")
    assert [len(h.tokens[r]) for r in "ABCD"] == [6, 6, 6, 2]


def test_newest_request_needing_a_block_preempts_itself():
    h = Harness(cfg(block_size=2, num_blocks=5, max_num_seqs=2))
    h.add("A", prompt_len=2, max_tokens=8)
    h.add("B", prompt_len=2, max_tokens=8)
    for _ in range(3):
        plan = h.step()
        assert set(h.scheduled_in(plan)) == {"A", "B"}
    plan = h.step()  # both need a third block, one is free: A gets it, B yields
    assert h.scheduled_in(plan) == {"A": 1}
    assert h.finished_ids(plan) == ["B"]
    assert h.scheduler.get_request("B").status is RequestStatus.PREEMPTED
    h.run()
    assert_alone_tokens(h, "A", "B")
    assert len(h.tokens["A"]) == len(h.tokens["B"]) == 8


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


# ---------------------------------------------------------------- abort


def test_abort_waiting_and_running():
    h = Harness(cfg(max_num_seqs=1))
    h.add("a", max_tokens=10)
    h.add("b", max_tokens=10)
    h.step()
    assert h.scheduler.num_running == 1 and h.scheduler.num_waiting == 1
    (out,) = h.abort("b")
    assert out.finish_reason == FinishReason.ABORT and out.new_token_ids == [] and out.scheduled_time is None
    (out,) = h.abort("a")
    assert out.finish_reason == FinishReason.ABORT and out.scheduled_time is not None
    assert h.scheduler.state.kv.gpu.num_held == 0
    assert h.abort("a", "nope") == []
    assert not h.scheduler.has_work() and h.schedule() is None
    h.add("c")
    plan = h.step()
    assert h.finished_ids(plan) == ["a"]  # b never reached the worker
    h.run()


def test_abort_between_schedule_and_update_drops_tokens():
    h = Harness(cfg())
    h.add("a", max_tokens=5)
    h.add("b", max_tokens=5)
    plan = h.schedule()
    (out,) = h.abort("a")
    assert out.finish_reason == FinishReason.ABORT
    free_after_abort = h.scheduler.state.kv.gpu.num_available
    outs = h.finish_step(plan)
    assert [o.request_id for o in outs] == ["b"]
    assert h.scheduler.state.kv.gpu.num_available == free_after_abort
    assert h.tokens["a"] == []
    plan = h.step()
    assert h.finished_ids(plan) == ["a"]
    h.run()
    assert_alone_tokens(h, "b")


def test_reused_id_during_the_step_is_not_confused_with_the_aborted_one():
    h = Harness(cfg())
    h.add("a", max_tokens=5)
    h.step()
    plan = h.schedule()
    h.abort("a")
    assert h.add("a", prompt_len=3, max_tokens=2) is None  # recorded as "a#1"
    assert h.finish_step(plan) == []
    plan = h.step()
    assert h.finished_ids(plan) == ["a"] and ids(plan.new_requests) == ["a"]
    assert plan.new_requests[0].token_ids == h.prompts["a#1"]
    h.run()
    assert len(h.tokens["a#1"]) == 2
    h.check_outcomes()


# ---------------------------------------------------------------- rejection


def test_unserviceable_requests_are_rejected_without_blocking_others():
    h = Harness(cfg(block_size=4, num_blocks=4, max_model_len=64))
    h.add("ok1", prompt_len=4, max_tokens=4)
    cases = {
        "empty": dict(prompt=[], max_tokens=4),
        "too_long": dict(prompt_len=60, max_tokens=5),
        "too_big": dict(prompt_len=16, max_tokens=4),  # 20 tokens = 5 blocks > 4
        "ok1": dict(prompt_len=2, max_tokens=2),  # duplicate of a live id
        "zero_max": dict(prompt_len=2, max_tokens=0),
        "bad_token": dict(prompt=[1, 5000], max_tokens=2),
    }
    words = {
        "empty": "empty",
        "too_long": "max_model_len",
        "too_big": "blocks",
        "ok1": "already in use",
        "zero_max": "max_tokens",
        "bad_token": "vocabulary",
    }
    for rid, kw in cases.items():
        out = h.add(rid, **kw)
        assert out is not None and out.finish_reason == FinishReason.ERROR, rid
        assert out.request_id == rid and words[rid] in out.error, (rid, out.error)
    h.add("ok2", prompt_len=4, max_tokens=4)
    assert h.scheduler.num_waiting == 2
    plan = h.step()
    assert ids(plan.new_requests) == ["ok1", "ok2"]
    assert h.scheduled_in(plan)["ok1"] == 4  # the original ok1, not the duplicate
    h.run()
    assert_alone_tokens(h, "ok1", "ok2")


def test_request_using_the_whole_pool_runs():
    h = Harness(cfg(block_size=4, num_blocks=4))
    h.add("big", prompt_len=12, max_tokens=4)
    h.add("small", prompt_len=2, max_tokens=2)
    h.run()
    assert_alone_tokens(h, "big", "small")
    assert len(h.tokens["big"]) == 4


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


# ---------------------------------------------------------------- static batching baseline


def test_static_batching_runs_each_batch_to_completion():
    """The baseline admits only into an empty batch: a short request's slot idles until the
    batch's longest member finishes, and nobody is preempted."""
    h = Harness(cfg(batching="static", max_num_seqs=2, num_blocks=16))
    h.add("short", prompt_len=4, max_tokens=1, ignore_eos=True)
    h.add("long", prompt_len=4, max_tokens=6, ignore_eos=True)
    h.add("next", prompt_len=4, max_tokens=2, ignore_eos=True)
    first = h.step()
    assert ids(first.new_requests) == ["short", "long"]
    steps_until_next = 1
    while True:
        plan = h.step()
        steps_until_next += 1
        if plan.new_requests:
            break
    assert ids(plan.new_requests) == ["next"]
    assert "long" in h.final and steps_until_next == 7  # 6 tokens for "long", then "next"
    h.run()
    assert h.scheduler.stats()["num_preemptions"] == 0
    assert_alone_tokens(h, "short", "long", "next")


def test_static_batch_reserves_blocks_for_whole_outputs():
    """Members are admitted only while blocks for every member's prompt + max_tokens remain."""
    h = Harness(cfg(batching="static", num_blocks=6, block_size=4))
    h.add("a", prompt_len=4, max_tokens=8, ignore_eos=True)  # 12 tokens: 3 blocks
    h.add("b", prompt_len=4, max_tokens=8, ignore_eos=True)  # 3 more: fills the pool
    h.add("c", prompt_len=2, max_tokens=2, ignore_eos=True)  # would need a 7th block
    plan = h.step()
    assert ids(plan.new_requests) == ["a", "b"]
    h.run()
    assert h.scheduler.stats()["num_preemptions"] == 0
    assert_alone_tokens(h, "a", "b", "c")


def test_batching_mode_is_validated():
    with pytest.raises(ValueError, match="batching"):
        cfg(batching="dynamic")
