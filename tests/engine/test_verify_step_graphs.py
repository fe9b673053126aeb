"""Speculative verify steps replayed from CUDA graphs give the tokens the same steps give run
eagerly, at contexts of several hundred tokens (the split-K paged decode kernel with several
query tokens per row, captured; more than one context bound), fp32 and bf16; in fp32 both equal
plain greedy decoding without speculation. Needs a GPU (``pytest -m gpu``); on CPU the static verify
step itself is covered by test_verify_step.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.engine.test_speculative import SPEC, _serve
from tests.engine.test_verify_step import pad_decode_runners, record_static_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def long_repetitive(i: int, length: int) -> list[int]:
    """A prompt of ``length`` tokens that repeats a phrase (its suffix recurs: proposals)."""
    phrase = [(11 * i + 5 * j) % 250 + 5 for j in range(7 + i)]
    return (phrase * (length // len(phrase) + 1))[:length]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_graph_tokens_equal_eager_tokens_at_long_contexts(dtype, tiny_checkpoint, tmp_path, monkeypatch):
    from conveyor import Engine
    from tests.worker.conftest import rewrite_config

    directory = tmp_path / "tiny-2048"
    shutil.copytree(tiny_checkpoint, directory)
    rewrite_config(directory, lambda config: config.update(max_position_embeddings=2048))
    # Eager runs pad like graphs (the same buckets and width: the same kernels, replayed or not).
    pad_decode_runners(monkeypatch)
    prompts = {f"r{i}": long_repetitive(i, n) for i, n in enumerate((300, 520, 700, 450))}
    config = dict(device="cuda", dtype=dtype, block_size=16, num_kv_blocks=256, max_batch_size=4, threads=2)
    outputs, verify = {}, {}
    for eager in (True, False):
        engine = Engine(directory, **config, **SPEC, enforce_eager=eager)
        assert (engine.runner.decode.graphs is None) == eager
        steps = record_static_steps(engine.runner)
        outputs[eager] = _serve(engine, prompts, 24)
        verify[eager] = [step for step in steps if step[2] > 1]
        assert engine.stats()["spec_accepted_tokens"] > 0
    assert verify[False] and verify[False] == verify[True]
    assert outputs[False] == outputs[True]
    if dtype == "float32":
        plain = _serve(Engine(directory, **config), prompts, 24)
        assert plain == outputs[False]
