"""Greedy tokens of the ModelRunner, fed scheduler-like plans, equal transformers' generate()
for every prompt alone: continuous batching, chunked prefill, paged KV and preemption must
not change a single token."""

from __future__ import annotations

import torch

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner

BLOCK_SIZE = 4


def prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, min_new_tokens=0)
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(checkpoint, scripted, script):
    name, directory, hf_model = checkpoint
    runner = ModelRunner(RunnerConfig(directory, block_size=BLOCK_SIZE, num_blocks=64))
    # Lengths: 1, a block multiple, non-multiples; 19 and 9 exceed the Mistral window of 8.
    p = prompts(runner.model_config.vocab_size, [1, 9, 19, 4, 6])
    scripts = [
        script("one-token", p[0], max_new=6),
        script("short", p[1], max_new=7, join=0),
        script("chunked", p[2], max_new=5, join=1, chunk=5),
        script("late", p[3], max_new=5, join=3),
        script("preempted", p[4], max_new=7, join=2, chunk=4, preempt_after=3),
    ]
    driver = scripted(runner, scripts)
    outputs = driver.run()
    assert max(driver.batch_sizes) >= 4, "requests must decode together in one flattened batch"
    for s in scripts:
        assert outputs[s.request_id] == hf_greedy(hf_model, s.prompt, s.max_new), (name, s.request_id)
    assert runner.request_ids == []


def test_triton_backend_greedy_matches_transformers(checkpoint_factory, scripted, script):
    """The same scheduler-like script through the Triton kernels (interpreted on CPU, compiled
    on a GPU): decode steps take the split-K decode kernel, the rest the extend kernel."""
    for name in ("llama", "qwen3", "mistral_window", "gemma3"):
        directory, hf_model = checkpoint_factory(name)
        runner = ModelRunner(RunnerConfig(directory, block_size=BLOCK_SIZE, num_blocks=64, attention="triton"))
        assert type(runner.model.layers[0].self_attn.backend).__name__ == "TritonPagedAttention"
        p = prompts(runner.model_config.vocab_size, [1, 11, 6])
        scripts = [
            script("one-token", p[0], max_new=4),
            script("chunked", p[1], max_new=4, join=0, chunk=4),
            script("late", p[2], max_new=3, join=2),
        ]
        outputs = scripted(runner, scripts).run()
        for s in scripts:
            assert outputs[s.request_id] == hf_greedy(hf_model, s.prompt, s.max_new), (name, s.request_id)
