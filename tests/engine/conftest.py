"""Fixtures of the engine's tests: ``conveyor.Engine`` on tests/e2e's tiny random Llama
(``tiny_checkpoint``, and ``hf_greedy``, transformers' greedy continuation of it: the
reference), imported here so that pytest registers them for this package too; and on the
demo model where the text matters (its weights are random too, but it is larger, so its
greedy text is varied enough to cut with stop strings)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import draft_checkpoint, hf_controlled, hf_greedy, hf_logprobs, hf_pooled, tiny_checkpoint  # noqa: F401  (fixtures, registered here)

# Small blocks, so prompts span several and the prefix cache's reuse shows in block counts.
TINY = dict(block_size=4, num_kv_blocks=128, threads=2, device="cpu")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def tiny_engine(tiny_checkpoint):
    """A new engine on the tiny checkpoint per call: ``tiny_engine(**config)``."""
    from conveyor import Engine

    def make(**config):
        return Engine(tiny_checkpoint, **{**TINY, **config})

    return make


@pytest.fixture(scope="module")
def demo_engine():
    """One engine on the demo model for a module (its requests are removed by each test)."""
    from conveyor import Engine

    return Engine("demo", num_kv_blocks=256, threads=2, device="cpu")


def run_all(engine) -> list:
    """Step until no request is pending; the StepOutputs, in order."""
    outs = []
    while engine.has_pending_requests():
        outs.append(engine.step())
        assert outs[-1].batch is not None or outs[-1].requests, "pending requests but nothing ran"
    return outs
