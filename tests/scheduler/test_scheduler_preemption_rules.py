"""One deterministic scenario per scheduling rule of issue 5, driven through the checking
FakeWorker (which verifies every plan and the *contents* of every KV slot a request relies
on, so a wrong prefix hit, swap or partial-block takeover fails at the step it happens).

Here the rules of contention, who yields and who is refused: priority order, aging and
priority preemption (for a slot, for blocks, against a request mid-prefill); the bounded
queue's overloaded and timeout errors, which spare running and preempted requests; swap /
recompute / auto preemption, and a failed swap out or in.
"""

from __future__ import annotations

import pytest

from conveyor.ipc.messages import FinishReason
from conveyor.scheduler.request import RequestStatus
from tests.scheduler.scenario_helpers import new_ids, new_req
from tests.scheduler.scenario_helpers import rules_cfg as cfg
from tests.scheduler.scheduler_harness import Harness


def run_until(h: Harness, predicate, limit: int = 500):
    for _ in range(limit):
        plan = h.step()
        if plan is not None and predicate(plan):
            return plan
    raise AssertionError("condition never met")


def _pressure(mode: str, **extra) -> Harness:
    """Two long decodes in a pool that holds only one of them to the end."""
    h = Harness(cfg(num_blocks=8, block_size=4, max_num_seqs=2, preemption=mode, **extra))
    h.add("A", prompt_len=6, max_tokens=20)  # 26 tokens: 7 blocks
    h.add("B", prompt_len=6, max_tokens=20)
    return h


# ---------------------------------------------------------------- priority


def test_priority_orders_the_waiting_queue():
    h = Harness(cfg(policy="priority", aging_rate=0.0, max_num_seqs=1))
    h.add("blocker", prompt_len=2, max_tokens=2)
    h.step()
    h.add("low", prompt_len=2, max_tokens=1, priority=0)
    h.add("high", prompt_len=2, max_tokens=1, priority=5)
    h.add("mid", prompt_len=2, max_tokens=1, priority=2)
    order = []
    while h.scheduler.has_work():
        plan = h.step()
        order += [r for r in new_ids(plan) if r != "blocker"]
    assert order == ["high", "mid", "low"]
    h.check_outcomes()


def test_fcfs_ignores_priority():
    h = Harness(cfg(max_num_seqs=1))
    h.add("blocker", prompt_len=2, max_tokens=2)
    h.step()
    h.add("low", prompt_len=2, max_tokens=1, priority=0)
    h.add("high", prompt_len=2, max_tokens=1, priority=5)
    order = []
    while h.scheduler.has_work():
        order += [r for r in new_ids(h.step()) if r != "blocker"]
    assert order == ["low", "high"]


def test_higher_priority_preempts_when_no_slot_is_free():
    h = Harness(cfg(policy="priority", aging_rate=0.0, max_num_seqs=2, preemption="recompute"))
    h.add("a", prompt_len=3, max_tokens=20, priority=0)
    h.add("b", prompt_len=3, max_tokens=20, priority=1)
    h.step()
    h.step()
    h.add("vip", prompt_len=3, max_tokens=2, priority=9)
    plan = h.step()
    assert new_ids(plan) == ["vip"]
    assert h.finished_ids(plan) == ["a"]  # the lowest-ranked running request yields
    assert "a" not in h.scheduled_in(plan) and h.scheduled_in(plan)["b"] == 1
    assert h.scheduler.get_request("a").status is RequestStatus.PREEMPTED
    h.run()
    h.check_outcomes()
    assert h.final["a"].finish_reason == FinishReason.LENGTH


def test_higher_priority_preempts_when_blocks_run_out():
    h = Harness(cfg(policy="priority", aging_rate=0.0, num_blocks=8, block_size=4, preemption="recompute"))
    h.add("low", prompt_len=24, max_tokens=4, priority=0)  # 6 of the 8 blocks
    h.step()
    h.add("vip", prompt_len=12, max_tokens=2, priority=3)  # needs 3 blocks, 2 are free
    plan = h.step()
    assert new_ids(plan) == ["vip"] and h.finished_ids(plan) == ["low"]
    h.run()
    h.check_outcomes()


def test_priority_preemption_happens_only_if_it_makes_room():
    """Preempting every lower-ranked request would still not fit the newcomer: nobody yields."""
    h = Harness(cfg(policy="priority", aging_rate=0.0, num_blocks=8, block_size=4))
    h.add("mid", prompt_len=20, max_tokens=4, priority=5)  # 5 blocks, outranks the newcomer
    h.add("low", prompt_len=4, max_tokens=4, priority=0)  # 1 block
    h.step()
    h.add("big", prompt_len=16, max_tokens=4, priority=3)  # 4 blocks: only 2 free + 1 from "low"
    plan = h.step()
    assert not plan.finished_slots and not plan.new_requests
    assert h.scheduler.stats()["num_preemptions"] == 0
    h.run()
    h.check_outcomes()


def test_high_priority_arrival_takes_the_budget_from_a_low_priority_prompt_being_chunked():
    h = Harness(cfg(policy="priority", aging_rate=0.0, max_num_batched_tokens=8, num_blocks=128, max_model_len=512))
    h.add("bulk", prompt_len=200, max_tokens=2, priority=0)
    h.step()
    h.step()
    h.add("vip", prompt_len=8, max_tokens=3, priority=5)
    plan = h.step()
    assert h.scheduled_in(plan) == {"vip": 8}  # the whole budget, bulk's chunk waits a step
    plan = h.step()
    assert h.scheduled_in(plan) == {"vip": 1, "bulk": 7}
    h.run()
    h.check_outcomes()


def test_aging_lets_a_low_priority_request_overtake_later_high_priority_ones():
    rate = 2.0  # priority points per second waited
    h = Harness(cfg(policy="priority", aging_rate=rate, max_num_seqs=1))
    h.add("blocker", prompt_len=2, max_tokens=3)
    h.step()
    h.add("old-low", prompt_len=2, max_tokens=1, priority=0)
    h.clock.advance(2.0)  # old-low's effective priority is now 4
    h.add("new-3", prompt_len=2, max_tokens=1, priority=3)  # arrived 2 s later: 3 < 0 + 2 * 2
    h.add("new-5", prompt_len=2, max_tokens=1, priority=5)  # 5 > 4: still ahead of it
    order = []
    while h.scheduler.has_work():
        order += [r for r in new_ids(h.step()) if r != "blocker"]
    assert order == ["new-5", "old-low", "new-3"]


def test_a_preempted_request_keeps_its_place_in_line():
    h = Harness(cfg(policy="priority", aging_rate=0.0, max_num_seqs=2, preemption="recompute"))
    h.add("a", prompt_len=3, max_tokens=10, priority=1)
    h.add("b", prompt_len=3, max_tokens=10, priority=0)
    h.step()
    h.add("vip", prompt_len=3, max_tokens=5, priority=9)
    plan = h.step()
    assert h.finished_ids(plan) == ["b"]
    h.add("later", prompt_len=3, max_tokens=2, priority=0)  # same priority as b, but later
    admitted = []
    while h.scheduler.has_work():
        admitted += new_ids(h.step())
    assert admitted.index("b") < admitted.index("later")
    h.check_outcomes()


# ---------------------------------------------------------------- bounded queue


def test_overloaded_when_the_queue_is_full_and_running_requests_go_on():
    h = Harness(cfg(max_num_seqs=1, max_waiting=2))
    h.add("run", prompt_len=2, max_tokens=5)
    h.step()
    assert h.add("w1") is None and h.add("w2") is None
    out = h.add("w3")
    assert out.finish_reason == FinishReason.ERROR and out.error.startswith("overloaded:")
    assert h.scheduler.stats()["num_overloaded"] == 1
    h.run()
    h.check_outcomes()
    assert h.final["run"].finish_reason == FinishReason.LENGTH


def test_timeout_for_requests_that_wait_too_long_but_not_for_running_or_preempted_ones():
    h = Harness(cfg(max_num_seqs=1, max_queue_time=5.0))
    h.add("run", prompt_len=2, max_tokens=30)
    h.step()
    h.add("late", prompt_len=2, max_tokens=2)
    h.clock.advance(4.0)
    h.step()
    assert "late" not in h.final
    h.clock.advance(1.5)
    h.step()
    assert h.final["late"].finish_reason == FinishReason.ERROR
    assert h.final["late"].error.startswith("timeout:")
    assert h.scheduler.stats()["num_timed_out"] == 1
    assert h.scheduler.get_request("run").status is RequestStatus.RUNNING
    h.clock.advance(100.0)  # a running request is never timed out
    h.run()
    assert h.final["run"].finish_reason == FinishReason.LENGTH


def test_preempted_requests_are_not_timed_out():
    h = _pressure("recompute", max_queue_time=1.0)
    run_until(h, lambda p: p.finished_slots)
    h.clock.advance(50.0)
    h.run()
    h.check_outcomes()
    assert all(o.finish_reason == FinishReason.LENGTH for o in h.final.values())


# ---------------------------------------------------------------- swap, recompute, auto


def test_swap_preemption_moves_blocks_out_and_back_without_recompute():
    h = _pressure("swap", num_cpu_blocks=16)
    plan = run_until(h, lambda p: p.swap_out)
    assert h.finished_ids(plan) == ["B"]
    b = h.scheduler.get_request("B")
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens > 0
    computed_at_swap = b.num_computed_tokens
    assert len(plan.swap_out) == len(b.cpu_blocks) == -(-computed_at_swap // 4)
    resume = run_until(h, lambda p: "B" in new_ids(p))
    # Blocks whose GPU copy is still cached are shared again instead of swapped in.
    assert 1 <= len(resume.swap_in) <= len(plan.swap_out)
    assert {g for _, g in resume.swap_in} <= set(new_req(resume, "B").block_ids)
    assert new_req(resume, "B").num_computed_tokens == computed_at_swap  # the FakeWorker checked every slot
    h.run()
    h.check_outcomes()
    stats = h.scheduler.stats()
    assert stats["num_preemptions_swap"] >= 1 and stats["num_preemptions_recompute"] == 0
    assert stats["swapped_blocks"] == 0


def test_recompute_preemption_drops_the_kv():
    h = _pressure("recompute", num_cpu_blocks=16)
    plan = run_until(h, lambda p: p.finished_slots)
    assert not plan.swap_out
    assert h.scheduler.get_request("B").status is RequestStatus.PREEMPTED
    h.run()
    h.check_outcomes()
    assert h.scheduler.stats()["num_preemptions_swap"] == 0


def test_swap_falls_back_to_recompute_when_the_cpu_space_is_full():
    h = _pressure("swap", num_cpu_blocks=2)  # B's KV needs more than 2 CPU blocks by then
    plan = run_until(h, lambda p: p.finished_slots)
    assert not plan.swap_out
    h.run()
    h.check_outcomes()
    assert h.scheduler.stats()["num_preemptions_recompute"] >= 1


@pytest.mark.parametrize(
    "block_bytes, expected",
    [(1_000, "swap"), (50_000_000, "recompute")],  # cheap to move vs. dearer to move than to recompute
)
def test_auto_preemption_compares_moving_with_recomputing(block_bytes, expected):
    h = _pressure("auto", num_cpu_blocks=16, block_bytes=block_bytes, swap_bandwidth=1e9, prefill_rate=1000.0)
    run_until(h, lambda p: p.finished_slots)
    stats = h.scheduler.stats()
    assert stats[f"num_preemptions_{expected}"] == 1 and stats["num_preemptions"] == 1
    h.run()
    h.check_outcomes()


def test_a_swapped_request_shares_blocks_still_on_the_gpu_when_it_resumes():
    """A victim holds nothing on the GPU while swapped out; on resume, its prefix blocks that
    a running request still holds are shared again, not swapped in."""
    prefix = list(range(1, 9))  # two full blocks
    h = Harness(cfg(num_blocks=10, block_size=4, max_num_seqs=2, preemption="swap", num_cpu_blocks=16))
    h.add("A", prompt=prefix + [50], max_tokens=24)
    h.step()
    h.add("B", prompt=prefix + [60], max_tokens=24)
    out = run_until(h, lambda p: p.swap_out)
    b = h.scheduler.get_request("B")
    assert all(x == -1 for x in b.block_ids) and len(out.swap_out) == len(b.cpu_blocks)
    shared = h.scheduler.get_request("A").block_ids[:2]
    resume = run_until(h, lambda p: "B" in new_ids(p))
    assert new_req(resume, "B").block_ids[:2] == shared
    assert len(resume.swap_in) <= len(out.swap_out) - 2
    h.run()
    h.check_outcomes()


# ---------------------------------------------------------------- failed steps


def _fail_first_plan_with(h: Harness, attr: str):
    for _ in range(500):
        plan = h.schedule()
        if getattr(plan, attr):
            h.worker.fail_steps.add(plan.step_id)  # the fake worker then skips the copies
            h.finish_step(plan)
            return plan
        h.finish_step(plan)
    raise AssertionError(f"no plan with {attr}")


def test_a_victim_whose_swap_out_failed_is_recomputed():
    h = _pressure("swap", num_cpu_blocks=16)
    _fail_first_plan_with(h, "swap_out")
    b = h.scheduler.get_request("B")
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not b.cpu_blocks
    h.run()
    h.check_outcomes()  # and the FakeWorker checked that nobody read the copies that never ran
    assert h.final["B"].finish_reason == FinishReason.LENGTH


def test_blocks_a_failed_swap_in_was_to_fill_are_not_trusted():
    h = Harness(cfg(num_blocks=8, block_size=4, num_cpu_blocks=16, offload_evicted=True))
    h.add("chat", prompt_len=14, max_tokens=2)
    h.run()
    context = h.context("chat")
    h.add("other", prompt_len=28, max_tokens=2)
    h.run()
    h.add("chat", prompt=context + [5, 6], max_tokens=2)
    _fail_first_plan_with(h, "swap_in")
    assert h.final["chat#1"].finish_reason == FinishReason.ERROR
    h.add("again", prompt=context + [7], max_tokens=2)  # the same prefix: must not hit garbage
    h.run()
    h.check_outcomes()
