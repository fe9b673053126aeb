"""Scenario tests of the continuous batcher's admission, driven through a checking FakeWorker:
who gets into each plan (max_num_seqs, the token budget, a waiting head short of blocks),
chunked prefill beside decodes, preemption of the newest request when blocks run out,
and requests rejected at arrival without blocking the others.

Every call goes through the Harness, which checks the scheduler's and the pool's
invariants (free + held == total among them) after it; every scenario ends with
``h.run()``, which steps until idle and asserts that every block is free again.
"""

from __future__ import annotations

from conveyor.ipc.messages import FinishReason
from conveyor.scheduler.request import RequestStatus
from tests.scheduler.scenario_helpers import assert_alone_tokens, cfg, ids
from tests.scheduler.scheduler_harness import Harness

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
