"""Decode steps replayed from CUDA graphs give the tokens the same steps give run eagerly
(``enforce_eager``), fp32 and bf16, for every supported family; sampled (seeded) requests too.
Needs a GPU (``pytest -m gpu``); on CPU the static decode step itself is covered by
test_decode_step.py."""

from __future__ import annotations

import pytest
import torch

from conveyor.ipc.messages import SamplingParams
from conveyor.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3", "mistral_window"])
def test_graph_tokens_equal_eager_tokens(name, dtype, checkpoint_factory, scripted, script):
    directory, _ = checkpoint_factory(name)
    outputs = {}
    for eager in (True, False):
        runner = ModelRunner(
            directory, device="cuda", dtype=dtype, block_size=BLOCK_SIZE, num_blocks=64, max_num_seqs=8,
            enforce_eager=eager, pad_decode=True,  # the same buckets: the same kernels, replayed or not
        )
        assert (runner._graphs is None) == eager
        if not eager:
            assert len(runner._graphs) > 0
        vocab = runner.model_config.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1, 17, 40, 5, 9)]
        scripts = [
            script("one-token", prompts[0], max_new=10),
            script("chunked", prompts[1], max_new=9, join=0, chunk=7),
            script("long", prompts[2], max_new=8, join=1),
            script("preempted", prompts[3], max_new=10, join=2, preempt_after=3),
            script("seeded", prompts[4], max_new=8, join=1, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
        ]
        outputs[eager] = scripted(runner, scripts).run()
    assert outputs[False] == outputs[True]
