"""The worker's half of swapping and prefix reuse: batched block copies between the GPU cache
and the CPU swap space, and resuming from KV it did not compute in this request's lifetime.

Greedy tokens must not change when a request is swapped out and back in (into different
blocks), nor when a second request starts from blocks a first one computed."""

from __future__ import annotations

import pytest
import torch

from conveyor.ipc.messages import NewRequestData, SamplingParams
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.block_transfer import transfer_blocks
from conveyor.worker.model_runner import ModelRunner
from tests.plans import CachedRow, plan

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [17, 4, 99, 250, 3, 8, 61, 12, 90, 5]


def test_transfer_blocks_moves_whole_blocks_of_every_layer():
    src = [torch.arange(2 * 5 * 2 * 3, dtype=torch.float32).view(2, 5, 2, 3) + 1000 * layer for layer in range(3)]
    dst = [torch.zeros(2, 4, 2, 3) for _ in range(3)]
    transfer_blocks(src, dst, [[4, 0], [1, 2]])
    for s, d in zip(src, dst):
        assert torch.equal(d[:, 0], s[:, 4]) and torch.equal(d[:, 2], s[:, 1])
        assert not d[:, 1].any() and not d[:, 3].any()
    transfer_blocks(src, dst, [])  # nothing to do


def alone(runner: ModelRunner, steps: int) -> list[int]:
    out = [
        runner.execute(
            plan(1, [NewRequestData("a", 0, PROMPT, GREEDY, [0, 1, 2, 3, 4], 0, len(PROMPT))], [], [])
        ).sampled_token_ids[0]
    ]
    for step in range(2, steps + 1):
        computed = len(PROMPT) + len(out) - 1
        out += runner.execute(plan(step, [], [CachedRow(0, [], computed, 1)], [])).sampled_token_ids
    runner.execute(plan(steps + 1, [], [], [0]))
    return out


ON_CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_a_request_swapped_out_and_back_in_continues_unchanged(llama_dir, device):
    """On CUDA the swap goes through the runner's own pinned, block-major swap space, the
    host side moving as runs of consecutive blocks (5-7 here) straight to and from it."""
    runner = ModelRunner(RunnerConfig(llama_dir, device=device, block_size=4, num_blocks=16, num_cpu_blocks=8))
    assert runner.swap_caches[0].shape[1] == 8 and runner.swap_caches[0].device.type == "cpu"
    assert runner.swap_caches[0].is_pinned() == (device == "cuda")
    reference = alone(runner, 8)

    out = [
        runner.execute(
            plan(10, [NewRequestData("a", 0, PROMPT, GREEDY, [0, 1, 2], 0, len(PROMPT))], [], [])
        ).sampled_token_ids[0]
    ]
    for step in (11, 12):
        computed = len(PROMPT) + len(out) - 1
        out += runner.execute(plan(step, [], [CachedRow(0, [], computed, 1)], [])).sampled_token_ids
    computed = len(PROMPT) + len(out) - 1  # 12 tokens in blocks 0, 1, 2
    # Swap out into CPU blocks 5, 6, 7; another request, on a's slot and GPU blocks,
    # overwrites them meanwhile.
    runner.execute(
        plan(
            13, [NewRequestData("b", 0, [1] * 12, GREEDY, [0, 1, 2], 0, 12)], [], [0], swap_out=[[0, 5], [1, 6], [2, 7]]
        )
    )
    runner.execute(plan(14, [], [], [0]))
    # Resume in other GPU blocks (and another slot), swapped in by the same plan: no recompute.
    resumed = NewRequestData("a", 3, PROMPT + out, GREEDY, [9, 10, 11, 12], computed, 1)
    result = runner.execute(plan(15, [resumed], [], [], swap_in=[[5, 9], [6, 10], [7, 11]]))
    out += result.sampled_token_ids
    for step in range(16, 16 + 4):
        computed = len(PROMPT) + len(out) - 1
        new_blocks = [13] if computed == 16 else []
        out += runner.execute(plan(step, [], [CachedRow(3, new_blocks, computed, 1)], [])).sampled_token_ids
    assert out == reference


def test_a_second_request_starts_from_blocks_another_computed(llama_dir):
    runner = ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=16))
    reference = alone(runner, 3)
    runner.execute(plan(10, [NewRequestData("first", 1, PROMPT, GREEDY, [4, 5, 6], 0, len(PROMPT))], [], []))
    # Blocks 4 and 5 hold the KV of PROMPT[:8]; the second request (on the first's slot)
    # shares them read-only.
    second = NewRequestData("second", 1, PROMPT, GREEDY, [4, 5, 7], 8, 2)
    out = runner.execute(plan(11, [second], [], [1])).sampled_token_ids
    for step in (12, 13):
        computed = len(PROMPT) + len(out) - 1
        out += runner.execute(plan(step, [], [CachedRow(1, [], computed, 1)], [])).sampled_token_ids
    assert out == reference


@pytest.mark.parametrize(
    "swap_out, swap_in, message",
    [
        ([[0, 8]], [], "swap_out pair"),
        ([], [[0, 99]], "swap_in pair"),
        ([[0, 1], [2, 1]], [], "writes a block twice"),
    ],
)
def test_bad_transfers_are_refused(llama_dir, swap_out, swap_in, message):
    runner = ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=16, num_cpu_blocks=8))
    with pytest.raises(ValueError, match=message):
        runner.execute(plan(1, [], [], [], swap_out=swap_out, swap_in=swap_in))
