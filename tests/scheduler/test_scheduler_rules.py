"""One deterministic scenario per scheduling rule of issue 5, driven through the checking
FakeWorker (which verifies every plan and the *contents* of every KV slot a request relies
on, so a wrong prefix hit, swap or partial-block takeover fails at the step it happens).

Rules: chunked prefill behind decodes; priority order, aging and priority preemption (for a
slot, for blocks, against a request mid-prefill); swap / recompute / auto preemption;
bounded head-of-line bypass; overloaded and timeout errors; prefix reuse (full and partial
blocks, LRU eviction); continuation from GPU, from CPU, or by recompute; batch formation by
min_batch_size / max_wait_ms; the per-iteration log.
"""

from __future__ import annotations

import pytest
from tests.scheduler.scheduler_harness import Harness

from conveyor.runtime.config import SchedulerConfig
from conveyor.ipc.messages import FinishReason
from conveyor.scheduler.iteration_log import ITERATION_FIELDS
from conveyor.scheduler.request import RequestStatus


def cfg(**overrides) -> SchedulerConfig:
    base = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    base.update(overrides)
    return SchedulerConfig(**base)


def new_ids(plan) -> list[str]:
    return [r.request_id for r in plan.new_requests]


def new_req(plan, rid):
    (r,) = [r for r in plan.new_requests if r.request_id == rid]
    return r


def check_arrives_computed(h: Harness, rid: str, computed: int, **request) -> None:
    """Add ``rid``; its first plan must start it at ``computed`` tokens (what the prefix cache
    or a continuation's kept KV saved it); then run everything out and check every output."""
    h.add(rid, **request)
    assert new_req(h.step(), rid).num_computed_tokens == computed
    h.run()
    h.check_outcomes()


def run_until(h: Harness, predicate, limit: int = 500):
    for _ in range(limit):
        plan = h.step()
        if plan is not None and predicate(plan):
            return plan
    raise AssertionError("condition never met")


# ---------------------------------------------------------------- chunked prefill


def test_decodes_run_every_iteration_while_an_older_long_prompt_is_chunked():
    """The long prompt ranks first (it arrived first), yet decodes are planned before it."""
    h = Harness(cfg(max_num_batched_tokens=16, num_blocks=128, max_model_len=512))
    chunks = h.chunks_beside_decodes(prompt_len=300, decode_tokens=60)
    assert max(chunks) == 14 and sum(chunks) == 300
    h.run()
    h.check_outcomes()


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


# ---------------------------------------------------------------- swap, recompute, auto


def _pressure(mode: str, **extra) -> Harness:
    """Two long decodes in a pool that holds only one of them to the end."""
    h = Harness(cfg(num_blocks=8, block_size=4, max_num_seqs=2, preemption=mode, **extra))
    h.add("A", prompt_len=6, max_tokens=20)  # 26 tokens: 7 blocks
    h.add("B", prompt_len=6, max_tokens=20)
    return h


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


# ---------------------------------------------------------------- head-of-line blocking


def test_small_requests_pass_a_blocked_big_one_a_bounded_number_of_times():
    h = Harness(cfg(num_blocks=10, block_size=4, max_bypass=3, max_num_seqs=8))
    h.add("hog", prompt_len=20, max_tokens=8)  # 6 of the 10 blocks from its first decode on
    h.step()
    h.add("big", prompt_len=20, max_tokens=4)  # needs 5 blocks: blocked
    for i in range(6):
        h.add(f"s{i}", prompt_len=2, max_tokens=6)  # one block each
    plan = h.step()
    assert new_ids(plan) == ["s0", "s1", "s2"]  # three pass "big", then the bound stops everyone
    assert h.scheduler.get_request("big").num_bypassed == 3
    admitted = []
    while h.scheduler.has_work():
        admitted += new_ids(h.step())
    assert admitted.index("big") < admitted.index("s3")  # nobody passes it any more
    h.check_outcomes()


def test_a_request_that_can_never_fit_is_rejected_at_once():
    h = Harness(cfg(num_blocks=4, block_size=4))
    out = h.add("huge", prompt_len=15, max_tokens=2)  # 17 tokens: 5 blocks > 4
    assert out is not None and out.finish_reason == FinishReason.ERROR and "blocks" in out.error
    assert h.scheduler.num_waiting == 0


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


# ---------------------------------------------------------------- prefix reuse


def test_a_repeated_prefix_is_shared_and_not_recomputed():
    system = list(range(100, 112))  # three full blocks of 4
    h = Harness(cfg())
    h.add("first", prompt=system + [1, 2], max_tokens=3)
    h.step()
    h.add("second", prompt=system + [3, 4, 5], max_tokens=3)
    plan = h.step()
    second = new_req(plan, "second")
    assert second.num_computed_tokens == 12 and h.scheduled_in(plan)["second"] == 3
    first = h.scheduler.get_request("first")
    assert second.block_ids[:3] == first.block_ids[:3]  # shared, not copied
    assert all(h.scheduler.state.kv.gpu.refcount(b) == 2 for b in second.block_ids[:3])
    h.run()
    h.check_outcomes()
    # Both finished: their full blocks stay cached (not free) until evicted.
    assert h.scheduler.state.kv.gpu.num_cached >= 3
    h.add("third", prompt=system + [9], max_tokens=2)
    plan = h.step()
    assert new_req(plan, "third").num_computed_tokens == 12
    stats = h.scheduler.stats()
    assert stats["prefix_cache_hit_tokens"] == 24
    h.run()


def test_the_last_token_is_always_computed_even_when_all_is_cached():
    h = Harness(cfg())
    prompt = list(range(200, 208))  # exactly two blocks
    h.add("a", prompt=prompt, max_tokens=2)
    h.run()
    check_arrives_computed(h, "b", 4, prompt=prompt, max_tokens=2)  # the second block is recomputed, not written into


def test_a_partly_filled_last_block_is_taken_over():
    h = Harness(cfg())
    h.add("a", prompt=list(range(300, 306)), max_tokens=1)  # 6 tokens: 1 full block + 2
    h.run()
    check_arrives_computed(h, "b", 6, prompt=list(range(300, 306)) + [7, 8, 9], max_tokens=1)


def test_cached_blocks_are_evicted_least_recently_used_first_and_from_the_end():
    h = Harness(cfg(num_blocks=6, block_size=4))
    h.add("old", prompt=list(range(10, 18)) + [1], max_tokens=1)  # 2 full blocks cached later
    h.run()
    h.add("new", prompt=list(range(40, 48)) + [1], max_tokens=1)
    h.run()
    h.add("filler", prompt_len=13, max_tokens=3)  # 4 blocks: evicts old's first, keeps new's
    h.run()
    check_arrives_computed(h, "new-again", 8, prompt=list(range(40, 48)) + [2], max_tokens=1)


# ---------------------------------------------------------------- continuation


def test_continuation_costs_only_its_new_tokens():
    h = Harness(cfg())
    h.add("chat", prompt_len=10, max_tokens=5)
    h.run()
    context = h.context("chat")  # prompt + the 5 outputs; the last output's KV was never computed
    h.add("chat", prompt=context + [11, 12, 13], max_tokens=4)
    plan = h.step()
    turn2 = new_req(plan, "chat")
    assert turn2.num_computed_tokens == len(context) - 1
    assert h.scheduled_in(plan)["chat"] == 4  # the last output token + 3 new ones
    h.run()
    h.check_outcomes()
    assert len(h.tokens["chat#1"]) == 4


def test_continuation_swaps_evicted_kv_back_in_from_the_cpu():
    h = Harness(cfg(num_blocks=8, block_size=4, num_cpu_blocks=16, offload_evicted=True))
    h.add("chat", prompt_len=14, max_tokens=2)  # 15 computed tokens: 3 full blocks + 3
    h.run()
    context = h.context("chat")
    h.add("other", prompt_len=28, max_tokens=2)  # needs every GPU block: chat's are evicted
    h.run()
    evicted = h.scheduler.stats()["num_swapped_out_blocks"]
    assert evicted >= 3  # the full blocks were offloaded as they were evicted
    h.add("chat", prompt=context + [5, 6], max_tokens=2)
    plan = h.step()
    turn2 = new_req(plan, "chat")
    assert turn2.num_computed_tokens == 12  # 3 full blocks from the CPU; the partial one was lost
    assert len(plan.swap_in) == 3
    h.run()
    h.check_outcomes()


def test_continuation_recomputes_when_its_kv_is_gone():
    h = Harness(cfg(num_blocks=8, block_size=4))
    h.add("chat", prompt_len=14, max_tokens=2)
    h.run()
    context = h.context("chat")
    h.add("other", prompt_len=28, max_tokens=2)
    h.run()
    check_arrives_computed(h, "chat", 0, prompt=context + [5, 6], max_tokens=2)


# ---------------------------------------------------------------- batch formation


def test_min_batch_size_waits_for_company_but_not_past_max_wait():
    h = Harness(cfg(min_batch_size=3, max_wait_ms=50))
    h.add("a")
    h.add("b")
    assert h.schedule() is None  # two waiting, the oldest has waited 0 ms
    assert h.scheduler.seconds_until_ready() == pytest.approx(0.05)
    h.clock.advance(0.02)
    h.add("c")
    plan = h.step()
    assert new_ids(plan) == ["a", "b", "c"]
    h.add("d")
    h.clock.advance(0.049)
    plan = h.step()
    assert "d" not in h.scheduled_in(plan)  # running decodes go on without it
    assert set(h.scheduled_in(plan)) == {"a", "b", "c"}
    h.clock.advance(0.002)
    plan = h.step()
    assert "d" in new_ids(plan)
    h.run()
    h.check_outcomes()


# ---------------------------------------------------------------- iteration log


def test_each_iteration_records_its_batch_and_block_state():
    h = Harness(cfg(max_num_batched_tokens=10))
    h.add("a", prompt_len=4, max_tokens=3)
    h.clock.advance(0.5)
    h.add("b", prompt_len=12, max_tokens=3)
    h.step()
    row = h.scheduler.iterations.last()
    assert set(row) == set(ITERATION_FIELDS)
    assert row["batch_size"] == 2 and row["num_new"] == 2 and row["admitted"] == 2
    assert row["prefill_tokens"] == 10 and row["decode_tokens"] == 0 and row["input_tokens"] == 10
    assert row["avg_wait"] == pytest.approx(0.25) and row["max_wait"] == pytest.approx(0.5)
    pool = h.scheduler.state.kv.gpu
    assert (row["free_blocks"], row["held_blocks"], row["cached_blocks"]) == (pool.num_free, pool.num_held, pool.num_cached)
    h.step()
    row = h.scheduler.iterations.last()
    assert row["decode_tokens"] == 1 and row["prefill_tokens"] == 6 and row["admitted"] == 0
    stats = h.scheduler.stats()
    assert stats["iteration_fields"] == list(ITERATION_FIELDS) and len(stats["recent_iterations"]) == 2
    h.run()


def test_the_iteration_log_is_bounded():
    h = Harness(cfg(iteration_log_size=4))
    h.add("a", max_tokens=20)
    h.run()
    assert len(h.scheduler.iterations) == 4


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
