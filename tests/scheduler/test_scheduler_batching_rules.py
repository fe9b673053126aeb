"""One deterministic scenario per scheduling rule of issue 5, driven through the checking
FakeWorker (which verifies every plan and the *contents* of every KV slot a request relies
on, so a wrong prefix hit, swap or partial-block takeover fails at the step it happens).

Here how a batch is formed and what a newcomer costs: chunked prefill behind decodes;
bounded head-of-line bypass; batch formation by min_batch_size / max_wait_ms; prefix reuse
(full and partial blocks, LRU eviction); continuation from GPU, from CPU, or by recompute;
the per-iteration log.
"""

from __future__ import annotations

import pytest

from conveyor.ipc.messages import FinishReason
from conveyor.scheduler.iteration_log import ITERATION_FIELDS
from tests.scheduler.scenario_helpers import new_ids, new_req
from tests.scheduler.scenario_helpers import rules_cfg as cfg
from tests.scheduler.scheduler_harness import Harness


def check_arrives_computed(h: Harness, rid: str, computed: int, **request) -> None:
    """Add ``rid``; its first plan must start it at ``computed`` tokens (what the prefix cache
    or a continuation's kept KV saved it); then run everything out and check every output."""
    h.add(rid, **request)
    assert new_req(h.step(), rid).num_computed_tokens == computed
    h.run()
    h.check_outcomes()


# ---------------------------------------------------------------- chunked prefill


def test_decodes_run_every_iteration_while_an_older_long_prompt_is_chunked():
    """The long prompt ranks first (it arrived first), yet decodes are planned before it."""
    h = Harness(cfg(max_num_batched_tokens=16, num_blocks=128, max_model_len=512))
    chunks = h.chunks_beside_decodes(prompt_len=300, decode_tokens=60)
    assert max(chunks) == 14 and sum(chunks) == 300
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
    assert (row["free_blocks"], row["held_blocks"], row["cached_blocks"]) == (
        pool.num_free,
        pool.num_held,
        pool.num_cached,
    )
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
