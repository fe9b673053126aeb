"""ModelRunner bookkeeping: plan validation (refused plans change nothing), KV pool sizing,
state dropping, and seeded sampling that survives batching and preemption."""

from __future__ import annotations

import pytest
import torch

from conveyor.common.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan
from conveyor.worker.kv_cache import bytes_per_block
from conveyor.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def runner(llama_dir) -> ModelRunner:
    return ModelRunner(llama_dir, block_size=4, num_blocks=16)


def new(rid: str, tokens: list[int], blocks: list[int], computed: int = 0, scheduled: int | None = None):
    scheduled = len(tokens) - computed if scheduled is None else scheduled
    return NewRequestData(rid, tokens, GREEDY, blocks, computed, scheduled)


def plan(step: int, new_requests=(), cached=(), finished=()) -> StepPlan:
    return StepPlan(step, list(new_requests), list(cached), list(finished))


def test_hand_written_steps(runner):
    # a: 6-token prompt in two chunks; b: 1-token prompt joining at step 1; both then decode.
    first = runner.execute(plan(0, [new("a", [5, 6, 7, 8, 9, 10], [3], scheduled=4)]))
    assert first.request_ids == [] and first.forward_time > 0
    second = runner.execute(plan(1, [new("b", [11], [0])], [CachedRequestData("a", [8], 4, 2)]))
    assert second.request_ids == ["b", "a"]
    third = runner.execute(plan(2, cached=[CachedRequestData("a", [], 6, 1), CachedRequestData("b", [], 1, 1)]))
    assert third.request_ids == ["a", "b"]
    assert runner.execute(plan(3, finished=["a", "b", "never-ran"])).request_ids == []
    assert runner.request_ids == []


@pytest.mark.parametrize(
    "bad_plan,message",
    [
        (plan(1, cached=[CachedRequestData("ghost", [], 0, 1)]), "unknown request 'ghost'"),
        (plan(1, cached=[CachedRequestData("a", [5], 8, 1)], finished=["a"]), "unknown request 'a'"),
        (plan(1, cached=[CachedRequestData("a", [5], 7, 1)]), "num_computed_tokens mismatch"),
        (plan(1, cached=[CachedRequestData("a", [], 8, 1)]), "block table too short"),
        (plan(1, [new("b", [1, 2, 3, 4, 5], [1])]), "block table too short"),
        (plan(1, [new("b", [1], [1]), new("b", [2], [2])]), "appears twice"),
        (plan(1, [new("c", [1], [1])], [CachedRequestData("c", [], 0, 1)]), "appears twice"),
        (plan(1, [new("a", [1], [1])]), "already running"),
        (plan(1, [new("b", [1, 2], [1], computed=1, scheduled=2)]), "only 2 tokens are known"),
        (plan(1, [new("b", [1], [99])]), r"block ids \[99\] outside"),
        (plan(1, [new("b", [1], [1], scheduled=0)]), "invalid counts"),
    ],
)
def test_invalid_plans_are_refused_without_side_effects(runner, bad_plan, message):
    """A refused plan changes nothing but dropping its finished requests (retired by the
    scheduler whatever else is wrong: keeping them would only leak their state)."""
    first = runner.execute(plan(0, [new("a", [5, 6, 7, 8, 9, 10, 11, 12], [3, 4])]))  # 8 tokens + 1 sampled
    with pytest.raises(ValueError, match=message):
        runner.execute(bad_plan)
    if "a" in bad_plan.finished_request_ids:
        assert runner.request_ids == []
        return
    assert runner.request_ids == ["a"]
    again = runner.execute(plan(2, cached=[CachedRequestData("a", [5], 8, 1)]))
    assert again.request_ids == ["a"] and first.request_ids == ["a"]


def test_plan_ahead_of_a_failed_step_fails_unrun(runner):
    """A plan formed while the previous one was in flight assumes it succeeded; after a
    failed step the worker refuses it (dropping only its finished requests), and runs the
    next plan formed in sync as usual."""
    runner.execute(plan(0, [new("a", [5, 6, 7], [3])]))
    with pytest.raises(ValueError, match="already running"):
        runner.execute(plan(1, [new("a", [1], [1])]))
    ahead = StepPlan(2, [new("b", [1, 2], [1])], [CachedRequestData("a", [], 3, 1)], ["x"], planned_ahead=True)
    with pytest.raises(ValueError, match="planned ahead of step 1, which failed"):
        runner.execute(ahead)
    assert runner.request_ids == ["a"]  # b was not taken in
    assert runner.execute(plan(3, cached=[CachedRequestData("a", [], 3, 1)])).request_ids == ["a"]
    # A plan planned ahead of a step that succeeded runs.
    ok = StepPlan(4, [], [CachedRequestData("a", [4], 4, 1)], [], planned_ahead=True)
    assert runner.execute(ok).request_ids == ["a"]


def test_pool_sized_from_memory_budget(llama_dir):
    probe = ModelRunner(llama_dir, block_size=8, num_blocks=1)
    per_block = bytes_per_block(probe.model_config, 8, torch.float32)
    assert per_block == 2 * 2 * 8 * 2 * 16 * 4  # k/v, layers, block, kv heads, head dim, fp32
    runner = ModelRunner(llama_dir, block_size=8, kv_cache_memory_bytes=10 * per_block + 5)
    assert runner.num_blocks == 10
    assert runner.kv_caches[0].shape == (2, 10, 8, 2, 16)
    with pytest.raises(ValueError, match="less than one block"):
        ModelRunner(llama_dir, block_size=8, kv_cache_memory_bytes=per_block - 1)
    with pytest.raises(ValueError, match="exactly one"):
        ModelRunner(llama_dir, block_size=8)


def test_seeded_sampling_survives_batching_and_preemption(llama_dir, scripted, script):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    prompt = [17, 4, 99, 250, 3, 8, 61]

    alone = scripted(ModelRunner(llama_dir, block_size=4, num_blocks=32), [script("s", prompt, 6, sampling=seeded)])
    reference = alone.run()["s"]

    mates = [
        script("m1", [9, 9, 9], 8, sampling=SamplingParams(temperature=0.8, top_k=5)),
        script("m2", [1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
        script("s", prompt, 6, join=1, chunk=3, sampling=seeded, preempt_after=2),
    ]
    batched = scripted(ModelRunner(llama_dir, block_size=4, num_blocks=32), mates, seed=1).run()
    assert batched["s"] == reference
    assert len(set(reference)) > 1
