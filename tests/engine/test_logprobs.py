"""conveyor.Engine's log-probabilities against HF transformers' log-softmax of the same
sequence: output tokens (top k in order), prompt tokens through chunked prefill, a prompt
that the prefix cache holds, stop strings cutting them with the tokens, and the bound."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import run_all


def check(entry, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(ref_row[token].item(), abs=1e-4)
    values, _ = ref_row.topk(k)
    assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    # ids: each top entry's id has its value in the reference (equal values may swap)
    assert [ref_row[t.token_id].item() for t in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert len({t.token_id for t in entry.top}) == k


def test_engine_logprobs_match_hf(tiny_engine, hf_logprobs):
    engine = tiny_engine(max_num_batched_tokens=8)  # the 21-token prompt runs in chunks
    prompt = list(range(3, 24))
    plain = engine.add_request(
        token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True
    )  # fills the prefix cache
    run_all(engine)
    assert plain.logprobs is None and plain.prompt_logprobs is None
    asked = engine.add_request(
        token_ids=prompt, max_tokens=6, temperature=0.9, seed=3, ignore_eos=True, logprobs=4, prompt_logprobs=2
    )
    other = engine.add_request(token_ids=[5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    run_all(engine)
    ref = hf_logprobs(prompt + asked.tokens)
    assert len(asked.logprobs) == 6
    for i, entry in enumerate(asked.logprobs):
        check(entry, ref[len(prompt) + i - 1], asked.tokens[i], 4)
    # every prompt token but the first, although the prefix cache held the prompt
    assert asked.prompt_logprobs[0] is None and len(asked.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        check(asked.prompt_logprobs[i], ref[i - 1], prompt[i], 2)
    ref_other = hf_logprobs([5, 6, 7] + other.tokens)
    assert [e.top for e in other.logprobs] == [[]] * 6
    for i, entry in enumerate(other.logprobs):
        assert entry.logprob == pytest.approx(ref_other[2 + i, other.tokens[i]].item(), abs=1e-4)


def test_logprobs_follow_a_stop_string_and_the_bound(demo_engine):
    req = demo_engine.add_request("Hello", max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    run_all(demo_engine)
    full = req.tokens
    req.remove()
    cut_text = req.text[2:6]
    stopped = demo_engine.add_request(
        "Hello", max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, stop=[cut_text]
    )
    run_all(demo_engine)
    stopped.remove()
    assert len(stopped.tokens) < len(full)
    assert [e.token_id for e in stopped.logprobs] == stopped.tokens
    with pytest.raises(ValueError, match="max-logprobs"):
        demo_engine.add_request("Hello", logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        demo_engine.add_request("Hello", prompt_logprobs=-1)


def test_prompt_logprobs_are_not_repeated_after_a_recompute_preemption(tiny_engine, hf_logprobs):
    # 12 blocks of 4 tokens: two 10-token prompts running to 40 tokens each cannot both fit,
    # so one is preempted and recomputes its prompt, whose log-probabilities were sent.
    engine = tiny_engine(num_kv_blocks=12)
    prompts = [list(range(30, 40)), list(range(60, 70))]
    reqs = [
        engine.add_request(token_ids=p, max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        for p in prompts
    ]
    run_all(engine)
    assert engine.stats()["num_preemptions"] > 0
    for prompt, req in zip(prompts, reqs):
        ref = hf_logprobs(prompt + req.tokens)
        assert len(req.prompt_logprobs) == len(prompt) and len(req.logprobs) == 30
        for i in range(1, len(prompt)):
            check(req.prompt_logprobs[i], ref[i - 1], prompt[i], 1)
        for i, entry in enumerate(req.logprobs):
            check(entry, ref[len(prompt) + i - 1], req.tokens[i], 1)


def test_logprobs_are_of_the_raw_logits_under_penalties(tiny_engine, hf_logprobs):
    # A penalized request draws from reshaped logits; its log-probabilities stay the model's
    # (vLLM's default): HF's log-softmax of the sequence it produced, not of the penalized logits.
    engine = tiny_engine()
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    req = engine.add_request(
        token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2,
        repetition_penalty=1.5, frequency_penalty=1.0, logit_bias={"9": 5.0},
    )  # fmt: skip
    run_all(engine)
    ref = hf_logprobs(prompt + req.tokens)
    for i, entry in enumerate(req.logprobs):
        check(entry, ref[len(prompt) + i - 1], req.tokens[i], 2)
