"""The worker on a CUDA device: the same scheduler-like script as the CPU tests, through the
Triton kernels, against HF transformers on the same device and dtype. Runs where a GPU
exists (``pytest -m gpu``); a machine without one has nothing to run here, and the same
kernels are covered on CPU by the interpreted tests."""

from __future__ import annotations

import pytest
import torch

from conveyor.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window"])
def test_cuda_greedy_matches_transformers(name, dtype, checkpoint_factory, scripted, script):
    directory, hf_cpu = checkpoint_factory(name)
    hf = type(hf_cpu).from_pretrained(directory, dtype=dtype).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    runner = ModelRunner(directory, device="cuda", dtype=dtype, block_size=BLOCK_SIZE, num_blocks=64)
    generator = torch.Generator().manual_seed(1)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (1, 17, 40, 5)]
    scripts = [
        script("one-token", prompts[0], max_new=8),
        script("chunked", prompts[1], max_new=8, join=0, chunk=7),
        script("long", prompts[2], max_new=6, join=1),
        script("preempted", prompts[3], max_new=8, join=2, preempt_after=3),
    ]
    outputs = scripted(runner, scripts).run()
    for s in scripts:
        with torch.no_grad():
            ids = torch.tensor([s.prompt], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=s.max_new,
                              pad_token_id=0)
        assert outputs[s.request_id] == ref[0, len(s.prompt):].tolist(), (name, dtype, s.request_id)


def _serve_greedy(directory, prompts: dict[str, list[int]], pipelined: bool) -> dict[str, list[int]]:
    """The scheduler and the runner in one process, planning ahead; ``pipelined`` launches each
    plan before finishing the step it was planned ahead of (worker/main.py's pipelined loop)."""
    from collections import deque

    from conveyor.common.config import SchedulerConfig
    from conveyor.common.messages import AddRequest, SamplingParams
    from conveyor.scheduler.scheduler import Scheduler

    runner = ModelRunner(directory, device="cuda", block_size=BLOCK_SIZE, num_blocks=64)
    config = SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256)
    sched = Scheduler(config, eos_token_ids=[], vocab_size=runner.model_config.vocab_size)
    tokens: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert sched.add_request(AddRequest(rid, prompt, sampling, 0.0)) is None
        tokens[rid] = []
    launched: deque = deque()

    def finish_oldest() -> None:
        plan, handle = launched.popleft()
        result = runner.finish(handle)
        assert result.error is None
        for out in sched.update(plan, result).expanded():
            tokens[out.request_id] += out.new_token_ids

    while sched.has_work() or launched:
        plan = sched.schedule() if not launched or sched.can_plan_ahead else None
        if plan is not None:
            launched.append((plan, runner.launch(plan)))
        if launched and (len(launched) == 2 or plan is None or not pipelined):
            finish_oldest()
    return tokens


def test_cuda_pipelined_steps_give_the_same_tokens(checkpoint_factory):
    """Decode inputs taken from the device-side buffer of the step still running give the
    tokens the plain loop gives (which the test above checks against transformers)."""
    directory, _ = checkpoint_factory("llama")
    generator = torch.Generator().manual_seed(2)
    prompts = {f"r{i}": torch.randint(3, 200, (n,), generator=generator).tolist() for i, n in enumerate((3, 30, 9, 17, 1, 50))}
    assert _serve_greedy(directory, prompts, pipelined=True) == _serve_greedy(directory, prompts, pipelined=False)
