"""A plan's swap-outs run before its swap-ins: a GPU block swapped out and swapped into by the
same plan sends its old contents to the CPU and then takes the incoming ones."""

from __future__ import annotations

import torch

from conveyor.kernels.block_copy import stacked
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from tests.plans import plan


def test_swap_out_then_in_within_one_plan(llama_dir):
    runner = ModelRunner(RunnerConfig(llama_dir, block_size=4, num_blocks=8, num_cpu_blocks=6))
    assert stacked(runner.kv_caches) is not None and stacked(runner.swap_caches) is not None
    gen = torch.Generator().manual_seed(0)
    for layer in runner.kv_caches + runner.swap_caches:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    gpu_before = [layer.clone() for layer in runner.kv_caches]
    cpu_before = [layer.clone() for layer in runner.swap_caches]
    # GPU 2 -> CPU 0 and GPU 3 -> CPU 1 (a run), while CPU 4 -> GPU 2 and CPU 0 -> GPU 5.
    runner.execute(plan(0, swap_out=[[2, 0], [3, 1]], swap_in=[[4, 2], [0, 5]]))
    for gpu, cpu, gpu_old, cpu_old in zip(runner.kv_caches, runner.swap_caches, gpu_before, cpu_before):
        assert torch.equal(cpu[:, 0], gpu_old[:, 2]) and torch.equal(cpu[:, 1], gpu_old[:, 3])
        assert torch.equal(gpu[:, 2], cpu_old[:, 4])
        assert torch.equal(gpu[:, 5], gpu_old[:, 2])  # CPU 0 as the swap-out left it
        untouched = [0, 1, 3, 4, 6, 7]
        assert torch.equal(gpu[:, untouched], gpu_old[:, untouched])
        assert torch.equal(cpu[:, 2:], cpu_old[:, 2:])
