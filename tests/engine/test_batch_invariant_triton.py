"""Batch-invariant mode's CUDA path, run on a CPU: the model's projections, its sampler's
softmaxes and log-softmax and its attention forced onto the Triton kernels (interpreted), the
engine serving a seeded request alone and then beside others, chunked: the same tokens and
log-probabilities bit for bit, and close to the CPU path's (the same model, other kernels).

The kernel tests (tests/kernels/test_invariant_*.py) carry the invariance's teeth (several key
splits, chunk boundaries inside them); this checks the wiring: each of the mode's kernels is
reached, and the served bits agree. (On this tiny model's short contexts the plain Triton
backend would pass the first test too: every key fits one tile.)"""

from __future__ import annotations

import pytest

from conveyor.kernels import layer_ops
from tests.engine.conftest import TINY

TARGET = [17, 250, 31, 9, 77, 140, 5, 63, 201, 12]
#: Seeded sampling with top-p (the sampler's softmaxes) and log-probabilities.
SEEDED = dict(temperature=0.9, top_p=0.95, seed=7, logprobs=3, max_tokens=4, ignore_eos=True)


def _engine(checkpoint, **config):
    from conveyor import Engine

    return Engine(checkpoint, **{**TINY, "num_kv_blocks": 128, "batch_invariant": True, **config})


def _serve(engine, company=()):
    """The target's tokens and, per token, its log-probability and top 3, served after ``company``."""
    for prompt, max_tokens in company:
        engine.add_request(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    target = engine.add_request(token_ids=TARGET, **SEEDED)
    while engine.has_pending_requests():
        engine.step()
    return target.tokens, [(e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in target.logprobs]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    """(the CPU path's target alone, the Triton path's alone, the Triton path's beside company),
    and which of the mode's kernels the Triton path reached."""
    cpu = _serve(_engine(tiny_checkpoint))
    from conveyor.kernels import invariant_attention, invariant_matmul, invariant_softmax

    reached: set[str] = set()

    def spy(module, name, label):
        kernel = getattr(module, name)

        def call(*args, **kwargs):
            reached.add(label(args, kwargs))
            return kernel(*args, **kwargs)

        patch.setattr(module, name, call)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_ops, "_use_triton", lambda x: True)
        spy(invariant_matmul, "invariant_linear", lambda a, k: "matmul")
        spy(invariant_softmax, "row_softmax", lambda a, k: "log-softmax" if (a[1:] or [k.get("log")])[0] else "softmax")
        spy(invariant_attention, "invariant_attention", lambda a, k: "attention")
        # One engine of 6-token steps: the target alone (its prefill cut 6 + 4), then again after a
        # companion of 5 tokens and one sharing its first 8 (cut elsewhere, its prefix cached).
        engine = _engine(tiny_checkpoint, attention="triton", max_num_batched_tokens=6)
        alone = _serve(engine)
        beside = _serve(engine, [([7] * 5, 3), (TARGET[:8] + [3], 2)])
    return cpu, alone, beside, reached


def test_the_triton_path_gives_a_request_the_same_bits_in_any_company(served):
    _, alone, beside, reached = served
    assert reached == {"matmul", "softmax", "log-softmax", "attention"}
    assert beside == alone


def test_the_triton_path_agrees_with_the_cpu_path(served):
    cpu, alone, _, _ = served
    assert alone[0] == cpu[0]
    for (lp, top), (cpu_lp, cpu_top) in zip(alone[1], cpu[1], strict=True):
        assert abs(lp - cpu_lp) < 1e-4
        assert [t for t, _ in top] == [t for t, _ in cpu_top]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top, cpu_top))
