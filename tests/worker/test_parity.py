"""The half-precision parity rule (tests/worker/parity.py) on synthetic logits, and bf16 greedy
parity of the CPU worker against HF transformers in bf16 under that rule."""

from __future__ import annotations

import pytest
import torch

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from tests.worker.parity import assert_greedy_agrees, assert_scripts_agree, parity_scripts

VOCAB = 50


def _logits(reference: list[int], ties: dict[int, int] | None = None, top: float = 20.0) -> torch.Tensor:
    """Logits whose argmax is ``reference[i]`` by a clear margin (2.0 at a top logit of 20,
    far above bf16 resolution); ``ties`` {step: other token} makes that step a near-tie."""
    rows = torch.zeros(len(reference), VOCAB)
    for step, token in enumerate(reference):
        rows[step, token] = top
        rows[step, (token + 1) % VOCAB] = top - 2.0
    for step, other in (ties or {}).items():
        rows[step, other] = top - top * 2.0**-8  # one unit of bf16 resolution below the top
    return rows


REFERENCE = [5, 9, 13, 2, 7, 11, 3, 4]


def test_identical_tokens_compare_all() -> None:
    assert assert_greedy_agrees(REFERENCE, REFERENCE, _logits(REFERENCE), torch.bfloat16, min_compared=3) == 8
    assert assert_greedy_agrees(REFERENCE, REFERENCE, _logits(REFERENCE), torch.float32, min_compared=3) == 8


def test_divergence_at_a_late_tie_passes() -> None:
    ours = REFERENCE[:5] + [30, 31, 32]  # picks the tied candidate at step 5, then its own continuation
    logits = _logits(REFERENCE, ties={5: 30})
    assert assert_greedy_agrees(ours, REFERENCE, logits, torch.bfloat16, min_compared=3) == 5


def test_agreement_through_a_tie_keeps_comparing() -> None:
    """A tie where both picked the same token does not end the comparison: a later clear
    divergence still fails."""
    ours = REFERENCE[:6] + [40, 4]
    with pytest.raises(AssertionError, match="token 6"):
        assert_greedy_agrees(ours, REFERENCE, _logits(REFERENCE, ties={2: 30}), torch.bfloat16, min_compared=1)


@pytest.mark.parametrize("step", [0, 1, 6])
def test_divergence_at_a_clear_margin_fails(step: int) -> None:
    ours = list(REFERENCE)
    ours[step] = (REFERENCE[step] + 1) % VOCAB  # HF's runner-up, 2.0 below: a clear margin
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_agrees(ours, REFERENCE, _logits(REFERENCE), torch.bfloat16, min_compared=1)


def test_tie_at_token_zero_fails() -> None:
    ours = [30] + REFERENCE[1:]
    with pytest.raises(AssertionError, match="tested nothing"):
        assert_greedy_agrees(ours, REFERENCE, _logits(REFERENCE, ties={0: 30}), torch.bfloat16, min_compared=1)


def test_tie_before_the_minimum_fails() -> None:
    ours = REFERENCE[:2] + [30] + REFERENCE[3:]
    with pytest.raises(AssertionError, match="tested nothing"):
        assert_greedy_agrees(ours, REFERENCE, _logits(REFERENCE, ties={2: 30}), torch.bfloat16, min_compared=3)


def test_a_token_outside_the_tie_fails() -> None:
    """At a near-tie of HF's top two, picking a third token far below them is still wrong."""
    ours = REFERENCE[:5] + [44] + REFERENCE[6:]
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_agrees(ours, REFERENCE, _logits(REFERENCE, ties={5: 30}), torch.bfloat16, min_compared=1)


def test_float32_allows_no_tie() -> None:
    ours = REFERENCE[:5] + [30, 31, 32]
    with pytest.raises(AssertionError, match="not a tie"):
        assert_greedy_agrees(ours, REFERENCE, _logits(REFERENCE, ties={5: 30}), torch.float32, min_compared=1)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_cpu_bf16_greedy_agrees_with_transformers(name, checkpoint_factory, scripted, script) -> None:
    """The CPU worker in bf16 (the torch path of every fused op) against HF in bf16, on Qwen3
    (every fused op, q/k norm included) and Gemma 3 (its (1 + w) norms rounded to bf16 once)."""
    directory, hf_fp32 = checkpoint_factory(name)
    hf = type(hf_fp32).from_pretrained(directory, dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    runner = ModelRunner(RunnerConfig(directory, dtype="bfloat16", block_size=16, num_blocks=64))
    scripts = parity_scripts(script, runner.model_config.vocab_size)
    assert_scripts_agree(scripted(runner, scripts).run(), scripts, hf, torch.bfloat16, label=name)
