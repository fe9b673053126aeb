"""ModelRunner bookkeeping: plan validation (refused plans change nothing), KV pool sizing,
state dropping, and seeded sampling that survives batching and preemption."""

from __future__ import annotations

import pytest
import torch

from conveyor.ipc.messages import NewRequestData, SamplingParams
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.model_runner import ModelRunner
from tests.plans import CachedRow, plan

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def runner(llama_dir) -> ModelRunner:
    return ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=16))


def new(rid: str, slot: int, tokens: list[int], blocks: list[int], computed: int = 0, scheduled: int | None = None):
    scheduled = len(tokens) - computed if scheduled is None else scheduled
    return NewRequestData(rid, slot, tokens, GREEDY, blocks, computed, scheduled)


def test_hand_written_steps(runner):
    # a (slot 0): 6-token prompt in two chunks; b (slot 3): 1-token prompt joining at step 1;
    # both then decode.
    first = runner.execute(plan(0, [new("a", 0, [5, 6, 7, 8, 9, 10], [3], scheduled=4)]))
    assert first.slots == [] and first.forward_time > 0
    second = runner.execute(plan(1, [new("b", 3, [11], [0])], [CachedRow(0, [8], 4, 2)]))
    assert second.slots == [3, 0]
    assert runner.slots == [0, 3] and runner.request_ids == ["a", "b"]
    third = runner.execute(plan(2, cached=[CachedRow(0, [], 6, 1), CachedRow(3, [], 1, 1)]))
    assert third.slots == [0, 3]
    assert runner.execute(plan(3, finished=[0, 3, 7])).slots == []  # 7: never held, fine
    assert runner.slots == [] and runner.request_ids == []


def test_block_tables_follow_the_requests_and_stay_small(llama_dir):
    """The runner's persistent block tables (a row per slot, gathered per step) hold each
    request's blocks and nothing of a slot's earlier owner, and grow with the largest slot
    and table seen, not beyond."""
    runner = ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=64))
    runner.execute(plan(0, [new(f"r{i}", i, [5, 6, 7], [2 * i, 2 * i + 1]) for i in range(9)]))
    assert runner.parts.requests.tables.shape[0] <= 2 * 9 and runner.parts.requests.tables.shape[1] <= 2 * 2
    runner.execute(plan(1, [new("x", 3, [9], [40])], [CachedRow(0, [30, 31, 32], 3, 1)], finished=[3]))
    assert runner.parts.requests.tables[0, :5].tolist() == [0, 1, 30, 31, 32]
    assert runner.parts.requests.tables[3].tolist()[:2] == [40, 0] and not runner.parts.requests.tables[3, 1:].any()
    assert runner.parts.requests.tables.shape[1] <= 2 * 5


def test_slot_is_reused_in_the_plan_that_drops_it(runner, llama_dir):
    """A slot freed by a finish or a preemption may be given to a new request in the very plan
    that drops it: the runner drops first, and the new owner starts from its own state."""
    step0 = runner.execute(plan(0, [new("a", 0, [5, 6, 7, 8], [0]), new("b", 1, [9, 10], [1])]))
    assert step0.slots == [0, 1]
    # a finishes; c takes its slot in the same plan, b runs on.
    step1 = runner.execute(plan(1, [new("c", 0, [1, 2, 3], [2])], [CachedRow(1, [], 2, 1)], finished=[0]))
    assert step1.slots == [0, 1] and runner.request_ids == ["c", "b"]
    # b is preempted and resumes on another slot, recomputing its tokens; its old slot 1 goes
    # to d in the same plan.
    b_tokens = [9, 10, step0.sampled_token_ids[1], step1.sampled_token_ids[1]]
    step2 = runner.execute(
        plan(2, [new("d", 1, [4, 4], [4]), new("b", 2, b_tokens, [5])], [CachedRow(0, [], 3, 1)], finished=[1])
    )
    assert step2.slots == [1, 2, 0] and runner.slots == [0, 1, 2]
    assert runner.request_ids == ["c", "d", "b"]
    # c's tokens are those of a runner that never saw its slot change hands.
    alone = ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=16))
    first = alone.execute(plan(0, [new("c", 5, [1, 2, 3], [2])]))
    second = alone.execute(plan(1, cached=[CachedRow(5, [], 3, 1)]))
    assert [
        step1.sampled_token_ids[0],
        step2.sampled_token_ids[2],
    ] == first.sampled_token_ids + second.sampled_token_ids


@pytest.mark.parametrize(
    "bad_plan,message",
    [
        (plan(1, cached=[CachedRow(5, [], 0, 1)]), "unknown slot 5"),
        (plan(1, cached=[CachedRow(-1, [], 0, 1)]), "unknown slot -1"),
        (plan(1, cached=[CachedRow(0, [5], 8, 1)], finished=[0]), "unknown slot 0"),
        (plan(1, cached=[CachedRow(0, [5], 7, 1)]), r"request 'a' \(slot 0\): num_computed_tokens mismatch"),
        (plan(1, cached=[CachedRow(0, [], 8, 1)]), "block table too short"),
        (plan(1, [new("b", 1, [1, 2, 3, 4, 5], [1])]), "block table too short"),
        (plan(1, [new("b", 1, [1], [1]), new("c", 1, [2], [2])]), r"slot 1 appears twice .*'b', then 'c'"),
        (plan(1, [new("c", 2, [1], [1])], [CachedRow(2, [], 0, 1)]), "slot 2 appears twice"),
        (plan(1, cached=[CachedRow(0, [5], 8, 1), CachedRow(0, [], 9, 1)]), "slot 0 appears twice"),
        (plan(1, [new("b", 0, [1], [1])]), "new request 'b' on slot 0, which request 'a' still holds"),
        (plan(1, [new("b", -1, [1], [1])]), "slot -1 outside"),
        (plan(1, [new("b", 1 << 20, [1], [1])]), "outside"),
        (plan(1, finished=[-2]), r"finished slots \[-2\] outside"),
        (plan(1, [new("b", 1, [1, 2], [1], computed=1, scheduled=2)]), "only 2 tokens are known"),
        (plan(1, [new("b", 1, [1], [99])]), r"block ids \[99\] outside"),
        (plan(1, [new("b", 1, [1], [1], scheduled=0)]), "invalid counts"),
    ],
)
def test_invalid_plans_are_refused_without_side_effects(runner, bad_plan, message):
    """A refused plan changes nothing but dropping its finished slots (retired by the
    scheduler whatever else is wrong: keeping them would only leak their state)."""
    first = runner.execute(plan(0, [new("a", 0, [5, 6, 7, 8, 9, 10, 11, 12], [3, 4])]))  # 8 tokens + 1 sampled
    with pytest.raises(ValueError, match=message):
        runner.execute(bad_plan)
    if 0 in bad_plan.finished_slots:
        assert runner.slots == []
        return
    assert runner.slots == [0] and runner.request_ids == ["a"]
    again = runner.execute(plan(2, cached=[CachedRow(0, [5], 8, 1)]))
    assert again.slots == [0] and first.slots == [0]


def test_plan_ahead_of_a_failed_step_fails_unrun(runner):
    """A plan formed while the previous one was in flight assumes it succeeded; after a
    failed step the worker refuses it (dropping only its finished slots), and runs the
    next plan formed in sync as usual."""
    runner.execute(plan(0, [new("a", 0, [5, 6, 7], [3]), new("x", 2, [1], [2])]))
    with pytest.raises(ValueError, match="still holds"):
        runner.execute(plan(1, [new("a2", 0, [1], [1])]))
    ahead = plan(2, [new("b", 1, [1, 2], [1])], [CachedRow(0, [], 3, 1)], [2], planned_ahead=True)
    with pytest.raises(ValueError, match="planned ahead of step 1, which failed"):
        runner.execute(ahead)
    assert runner.slots == [0] and runner.request_ids == ["a"]  # x dropped, b not taken in
    assert runner.execute(plan(3, cached=[CachedRow(0, [], 3, 1)])).slots == [0]
    # A plan planned ahead of a step that succeeded runs.
    ok = plan(4, [], [CachedRow(0, [4], 4, 1)], [], planned_ahead=True)
    assert runner.execute(ok).slots == [0]


class _DeviceError:
    """Stands in for a step's sampled ids whose copy to the host failed on the device."""

    def tolist(self):
        raise RuntimeError("device error")


def test_plan_ahead_of_a_step_failing_at_its_finish_fails_too(runner):
    """Pipelined: the plan planned ahead of step N is launched before N is finished. If N then
    fails at its finish, that plan's result is an error too; the next plan formed in sync runs,
    and a plan launched after a failed finish is refused unrun."""
    runner.execute(plan(0, [new("a", 0, [5, 6, 7], [3])]))
    first = runner.launch(plan(1, cached=[CachedRow(0, [], 3, 1)]))
    ahead = runner.launch(plan(2, cached=[CachedRow(0, [4], 4, 1)], planned_ahead=True))
    first.sampled, first.done = _DeviceError(), None
    with pytest.raises(RuntimeError, match="device error"):
        runner.finish(first)
    result = runner.finish(ahead)
    assert result.error == "step 2 was planned ahead of a step that failed" and result.slots == []
    with pytest.raises(ValueError, match="planned ahead of step 3, which failed"):
        runner.execute(plan(4, [new("b", 1, [1], [1])], finished=[0], planned_ahead=True))
    assert runner.slots == []  # a dropped, b not taken in
    assert runner.execute(plan(5, [new("c", 0, [1, 2], [1])])).slots == [0]
    # A step planned ahead of one that finished well runs.
    second = runner.launch(plan(6, cached=[CachedRow(0, [], 2, 1)]))
    third = runner.launch(plan(7, cached=[CachedRow(0, [], 3, 1)], planned_ahead=True))
    assert runner.finish(second).error is None and runner.finish(third).error is None


def test_pool_sized_from_memory_budget(llama_dir):
    probe = ModelRunner(RunnerConfig(llama_dir, block_size=8, num_blocks=1))
    per_block = KVCacheShape.of(probe.model_config, 8, torch.float32).bytes_per_block
    assert per_block == 2 * 2 * 8 * 2 * 16 * 4  # k/v, layers, block, kv heads, head dim, fp32
    runner = ModelRunner(RunnerConfig(llama_dir, block_size=8, kv_cache_memory_bytes=10 * per_block + 5))
    assert runner.num_blocks == 10
    assert runner.kv_caches[0].shape == (2, 10, 8, 2, 16)
    with pytest.raises(ValueError, match="less than one KV block"):
        ModelRunner(RunnerConfig(llama_dir, block_size=8, kv_cache_memory_bytes=per_block - 1))
    with pytest.raises(ValueError, match="exactly one"):
        ModelRunner(RunnerConfig(llama_dir, block_size=8))


def test_seeded_sampling_survives_batching_and_preemption(llama_dir, scripted, script):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    prompt = [17, 4, 99, 250, 3, 8, 61]

    alone = scripted(
        ModelRunner(
            RunnerConfig(
                llama_dir,
                block_size=4,
                num_blocks=32,
            ),
        ),
        [script("s", prompt, 6, sampling=seeded)],
    )
    reference = alone.run()["s"]

    mates = [
        script("m1", [9, 9, 9], 8, sampling=SamplingParams(temperature=0.8, top_k=5)),
        script("m2", [1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
        script("s", prompt, 6, join=1, chunk=3, sampling=seeded, preempt_after=2),
    ]
    batched = scripted(ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=32)), mates, seed=1).run()
    assert batched["s"] == reference
    assert len(set(reference)) > 1
