"""The worker on a CUDA device: the same scheduler-like script as the CPU tests, through the
Triton kernels, against HF transformers on the same device and dtype. Runs where a GPU
exists (``pytest -m gpu``); a machine without one has nothing to run here, and the same
kernels are covered on CPU by the interpreted tests."""

from __future__ import annotations

import pytest
import torch

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from tests.worker.parity import assert_scripts_agree, parity_scripts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window", "qwen3_moe", "mixtral"])
def test_cuda_greedy_matches_transformers(name, dtype, checkpoint_factory, scripted, script):
    directory, hf_cpu = checkpoint_factory(name)
    hf = type(hf_cpu).from_pretrained(directory, dtype=dtype).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    runner = ModelRunner(RunnerConfig(directory, device="cuda", dtype=dtype, block_size=BLOCK_SIZE, num_blocks=64))
    scripts = parity_scripts(script, runner.model_config.vocab_size, preempted=True)
    # float32: token for token; bf16: up to a divergence at one of HF's own near-ties.
    assert_scripts_agree(scripted(runner, scripts).run(), scripts, hf, dtype, label=f"{name} {dtype}")
