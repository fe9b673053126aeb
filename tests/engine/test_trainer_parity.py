"""Trainer-side parity (issue 42, the "training-inference mismatch" check; docs/rl.md): the
log-probabilities ``conveyor.Engine`` returns for the tokens it sampled, in a batch with
companions, decoded one token a step against the KV cache, against what a trainer computes
with a plain forward of prompt + completion as one sequence in the same dtype (float32):

- in batch-invariant mode, bit for bit against the project's own model run on that one
  sequence alone (one prefill, nothing beside it: its prompt log-probabilities), and within
  1e-5 of HF transformers' float32 forward;
- with the mode off, within 1e-5 of both, and (what makes the bitwise check mean something)
  not bit for bit against the one-sequence forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import run_all

PROMPTS = [[5, 9, 33, 120, 7, 64, 200, 18], list(range(3, 24)), [7, 8, 9], [40] * 13]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def rollouts(engine) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """The prompts sampled together (seeded, temperature 1): (prompt, completion, its tokens' log-probabilities)."""
    requests = [
        engine.add_request(token_ids=p, max_tokens=MAX_TOKENS, temperature=1.0, seed=i, ignore_eos=True, logprobs=0)
        for i, p in enumerate(PROMPTS)
    ]
    run_all(engine)
    return [(p, r.tokens, torch.tensor([e.logprob for e in r.logprobs])) for p, r in zip(PROMPTS, requests)]


def own_forward(engine, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's log-probabilities from one prefill of prompt + completion, alone."""
    request = engine.add_request(token_ids=prompt + completion, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    run_all(engine)
    return torch.tensor([request.prompt_logprobs[i].logprob for i in range(len(prompt), len(prompt) + len(completion))])


def hf_forward(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        rows = model(torch.tensor([prompt + completion])).logits[0].float().log_softmax(-1)
    return rows[len(prompt) - 1 : -1].gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "default"])
def test_sampled_logprobs_equal_a_plain_forward(tiny_engine, hf_model, invariant):
    sampled = rollouts(tiny_engine(batch_invariant=invariant))
    alone = tiny_engine(batch_invariant=invariant, max_num_batched_tokens=256)  # one chunk, one sequence
    bitwise = []
    for prompt, completion, got in sampled:
        own = own_forward(alone, prompt, completion)
        assert (got - hf_forward(hf_model, prompt, completion)).abs().max() <= 1e-5
        assert (got - own).abs().max() <= 1e-5
        bitwise.append(torch.equal(got, own))
    assert all(bitwise) if invariant else not all(bitwise), bitwise
