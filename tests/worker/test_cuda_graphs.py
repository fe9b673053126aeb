"""Decode steps replayed from CUDA graphs give the tokens the same steps give run eagerly
(``enforce_eager``), fp32 and bf16, for every supported family (the mixtures of experts through
the fused MoE kernels); sampled (seeded) requests too.
Needs a GPU (``pytest -m gpu``); on CPU the static decode step itself is covered by
test_decode_step.py."""

from __future__ import annotations

import pytest
import torch

from conveyor.ipc.messages import SamplingParams
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3", "mistral_window", "qwen3_moe", "mixtral"])
def test_graph_tokens_equal_eager_tokens(name, dtype, checkpoint_factory, scripted, script):
    directory, _ = checkpoint_factory(name)
    outputs = {}
    for eager in (True, False):
        runner = ModelRunner(
            RunnerConfig(
                directory,
                device="cuda",
                dtype=dtype,
                block_size=BLOCK_SIZE,
                num_blocks=64,
                max_num_seqs=8,
                enforce_eager=eager,
                pad_decode=True,  # the same buckets: the same kernels, replayed or not
            ),
        )
        assert (runner.decode.graphs is None) == eager
        if not eager:
            assert len(runner.decode.graphs) > 0
        vocab = runner.model_config.vocab_size
        prompts = [
            torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (1, 17, 40, 5, 9)
        ]
        scripts = [
            script("one-token", prompts[0], max_new=10),
            script("chunked", prompts[1], max_new=9, join=0, chunk=7),
            script("long", prompts[2], max_new=8, join=1),
            script("preempted", prompts[3], max_new=10, join=2, preempt_after=3),
            script(
                "seeded", prompts[4], max_new=8, join=1, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=3)
            ),
        ]
        outputs[eager] = scripted(runner, scripts).run()
    assert outputs[False] == outputs[True]


@pytest.mark.parametrize("lengths", [(700,), (700, 1040)], ids=["batch1", "batch2"])
def test_graph_tokens_equal_eager_tokens_at_long_contexts(lengths, checkpoint_factory, scripted, script, tmp_path):
    """The decode path most likely to break in a graph: ~700 and ~1,040-token contexts (the
    split-K attention and its reduce, captured; more than one context bound) in a 256-block
    pool, batch 1 and 2, on a model whose max_position_embeddings is 2048 (graphs sized for
    long contexts, not the 128 of the small checkpoints)."""
    import shutil

    from tests.worker.conftest import rewrite_config

    directory = tmp_path / "llama-2048"
    shutil.copytree(checkpoint_factory("llama")[0], directory)
    rewrite_config(directory, lambda config: config.update(max_position_embeddings=2048))
    outputs = {}
    for eager in (True, False):
        runner = ModelRunner(
            RunnerConfig(
                directory,
                device="cuda",
                dtype="bfloat16",
                block_size=BLOCK_SIZE,
                num_blocks=256,
                max_num_seqs=2,
                enforce_eager=eager,
                pad_decode=True,
            ),
        )
        assert runner.model_config.max_position_embeddings == 2048 and (runner.decode.graphs is None) == eager
        vocab = runner.model_config.vocab_size
        scripts = [
            script(
                f"r{n}",
                torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist(),
                max_new=24,
                join=i,
            )
            for i, n in enumerate(lengths)
        ]
        outputs[eager] = scripted(runner, scripts).run()
        assert all(len(out) == 24 for out in outputs[eager].values())
    assert outputs[False] == outputs[True]
