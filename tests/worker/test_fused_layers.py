"""The model's CUDA path on a CPU: every fused Triton kernel of a decoder layer (residual add +
RMSNorm, SiLU-and-multiply, and through the Triton attention backend rotary + q/k norm + KV
store), interpreted, must keep greedy parity with HF transformers in float32.

The kernel tests check each kernel against its reference; this checks how the model composes
them (the residual stream updated in place, strided views of the fused projections, the
per-head norm shape) through chunked prefill, batching and preemption.
"""

from __future__ import annotations

import pytest

from conveyor.kernels import layer_ops
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from tests.worker.test_generation import hf_greedy, prompts


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_fused_triton_layers_match_transformers(name, checkpoint_factory, scripted, script, monkeypatch):
    """Qwen3: the Llama variant that uses every fused kernel, q/k norm included; Gemma 3: the
    same kernels with its (1 + w) norms, norms without a residual (post-norms) and GeGLU."""
    forced: list[bool] = []
    monkeypatch.setattr(layer_ops, "_use_triton", lambda x: forced.append(True) or True)
    directory, hf_model = checkpoint_factory(name)
    runner = ModelRunner(RunnerConfig(directory, block_size=4, num_blocks=64, attention="triton"))
    p = prompts(runner.model_config.vocab_size, [1, 11, 6])
    scripts = [
        script("one-token", p[0], max_new=4),
        script("chunked", p[1], max_new=4, join=0, chunk=4),
        script("preempted", p[2], max_new=4, join=1, preempt_after=2),
    ]
    outputs = scripted(runner, scripts).run()
    for s in scripts:
        assert outputs[s.request_id] == hf_greedy(hf_model, s.prompt, s.max_new), (name, s.request_id)
    assert forced, "the layers never reached the Triton dispatch"
