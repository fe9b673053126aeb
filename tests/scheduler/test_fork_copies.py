"""Scripted scenarios of a parallel-sampling fork's block copy (``StepPlan.copy_blocks``)
meeting the other transfers of its plan, each checked by the FakeWorker's model of the KV
contents: every slot a request relies on must hold its own prefix.

- A fork's copy destination may be a block the same plan swaps out (a victim of the fork's
  admission, or a cached block evicted to the CPU tier): the worker runs the swap-outs
  before the copies, or the CPU copy holds the fork's prompt instead of the victim's KV.
- A fork's copy source may be a block the same plan swaps in (the first sequence resumed
  by it): the worker runs the swap-ins before the copies, or the copy reads stale KV.
- A failed plan's copy never ran: its destination, cached as a partial block when the
  failed sequence released it, must not serve a later prefix hit.
"""

from __future__ import annotations

from conveyor.runtime.config import SchedulerConfig
from tests.scheduler.scheduler_harness import Harness


def first_fork(h: Harness):
    """Step until a plan forks a sequence (has block copies); that plan."""
    while True:
        plan = h.step()
        assert plan is not None, "no plan forked a sequence"
        if plan.copy_blocks:
            return plan


def test_fork_copy_into_the_block_of_a_victim_swapped_out_by_the_same_plan():
    # Priority policy, a tiny budget (chunked prefill) and a pool of 5 blocks of 4: the
    # second sequence (ranked ahead of r1) can fork only by swapping r1 out, and takes r1's
    # block as its copy destination.
    cfg = SchedulerConfig(
        num_blocks=5,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=3,
        max_model_len=16,
        policy="priority",
        aging_rate=0.0,
        preemption="swap",
        num_cpu_blocks=2,
    )
    h = Harness(cfg)
    assert h.add("r0", prompt_len=14, max_tokens=2, n=2) is None
    assert h.add("r1", prompt_len=3, max_tokens=1) is None
    fork_plan = first_fork(h)
    # The scenario: the copy's destination is the block that plan swaps out.
    [(_, dst)] = fork_plan.copy_blocks
    assert dst in [g for g, _ in fork_plan.swap_out], (fork_plan.copy_blocks, fork_plan.swap_out)
    h.run()  # r1 swaps back in and relies on its first token's KV
    assert h.scheduler.stats()["num_preemptions_swap"] == 1
    h.check_outcomes()


def test_fork_copy_into_a_cached_block_offloaded_by_the_same_plan():
    # 4 blocks of 4: "a" leaves its 2 full blocks cached, the first sequence takes the 2 free
    # ones, and the fork's copy destination evicts a cached block, offloaded to the CPU.
    cfg = SchedulerConfig(
        num_blocks=4,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=16,
        num_cpu_blocks=4,
        offload_evicted=True,
    )
    h = Harness(cfg)
    a = [50 + i for i in range(8)]
    assert h.add("a", prompt=a, max_tokens=1) is None
    h.run()
    assert h.add("par", prompt=list(range(1, 8)), max_tokens=2, n=2) is None
    h.step()  # the first sequence prefills
    fork_plan = h.step()
    [(_, dst)] = fork_plan.copy_blocks
    assert dst in [g for g, _ in fork_plan.swap_out], (fork_plan.copy_blocks, fork_plan.swap_out)
    h.run()
    # "b" finds a's second block in the CPU tier only (swapped in): it must hold a's KV.
    assert h.add("b", prompt=a + [70], max_tokens=1) is None
    h.run()
    assert h.worker.num_computed_at_arrival["b"] == [8]
    h.check_outcomes()


def test_fork_from_a_first_sequence_swapped_in_by_the_same_plan():
    # 4 blocks of 4, 2 slots, no bypass: "hog" (ahead in line) grows until the first sequence
    # is swapped out; the second, queued behind it, waits; once hog finishes, one plan
    # resumes the first sequence and forks the second from the block it swaps in.
    cfg = SchedulerConfig(
        num_blocks=4,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len=16,
        preemption="swap",
        num_cpu_blocks=8,
        max_bypass=0,
    )
    h = Harness(cfg)
    assert h.add("hog", prompt_len=4, max_tokens=10) is None
    assert h.add("p", prompt_len=6, max_tokens=6, n=2) is None
    fork_plan = first_fork(h)
    [(src, _)] = fork_plan.copy_blocks
    assert src in [g for _, g in fork_plan.swap_in], (fork_plan.copy_blocks, fork_plan.swap_in)
    h.run()
    h.check_outcomes()


def test_failed_fork_copy_is_not_cached():
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    h = Harness(cfg)
    prompt = list(range(1, 8))  # 7 tokens: the fork shares block 0 and copies positions 4..5
    assert h.add("par", prompt=prompt, max_tokens=4, n=2) is None
    h.step()  # the first sequence prefills
    plan = h.schedule()
    assert plan.copy_blocks
    h.worker.fail_steps.add(plan.step_id)  # fails before its copy runs
    outs = h.finish_step(plan)
    assert sorted(o.finish_reason for o in outs) == ["error", "error"]
    # "x" takes over the first sequence's partial block (its 3 prompt tokens match best);
    # "y" shares only positions 4..5: the fork's copy destination must not be offered.
    assert h.add("x", prompt=prompt + [500], max_tokens=1) is None
    assert h.add("y", prompt=prompt[:6] + [600, 601], max_tokens=1) is None
    h.run()
    assert h.worker.num_computed_at_arrival["x"] == [7]
    assert h.worker.num_computed_at_arrival["y"] == [4]
    h.check_outcomes()
