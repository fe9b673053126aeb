"""Speculative decoding (n-gram proposer, greedy verification) through the engine: greedy output
with speculation equals greedy without it and HF transformers' token for token, on the
position-sensitive tiny checkpoint, through chunked prefill, recompute preemption and a
continued conversation, with prompts that repeat text so that proposals are accepted."""

from __future__ import annotations

import numpy as np

from tests.engine.conftest import GREEDY, run_all

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, ngram_max=3, ngram_min=1)


def repetitive(i: int) -> list[int]:
    """A prompt that repeats a short phrase, so its suffix recurs earlier in it."""
    phrase = [(7 * i + 3 * j) % 250 + 5 for j in range(3 + i % 3)]
    return phrase * 4 + phrase[:2]


def _serve(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    requests = {rid: engine.add_request(token_ids=p, request_id=rid, max_tokens=max_tokens, **GREEDY) for rid, p in prompts.items()}
    run_all(engine)
    for request in requests.values():
        assert request.done and request.finish_reason == "length", request
    return {rid: request.tokens for rid, request in requests.items()}


def test_propose_ngram_takes_what_followed_the_latest_longest_match():
    from conveyor.scheduler.speculation import propose_ngram

    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3], np.int64)
    assert propose_ngram(tokens, 3, 3, 1).tolist() == [4, 5, 7]  # "2 3" last seen before 4 5 7
    assert propose_ngram(tokens, 2, 3, 1).tolist() == [4, 5]
    assert propose_ngram(np.array([5, 6, 7], np.int64), 3, 3, 1).tolist() == []
    assert propose_ngram(np.array([8, 8], np.int64), 3, 3, 1).tolist() == [8]


def test_speculative_greedy_equals_plain_greedy_and_hf(tiny_engine, hf_greedy):
    prompts = {f"r{i}": repetitive(i) for i in range(6)}
    # Few blocks and a small budget: chunked prefills beside decodes, and recompute preemptions.
    config = dict(max_batch_size=4, max_batch_tokens=12, num_kv_blocks=24, preemption="recompute")
    spec_engine = tiny_engine(**config, **SPEC)
    spec = _serve(spec_engine, prompts, 20)
    stats = spec_engine.stats()
    plain = _serve(tiny_engine(**config), prompts, 20)
    for rid, p in prompts.items():
        assert spec[rid] == plain[rid] == hf_greedy(p, 20), rid
    assert stats["spec_accepted_tokens"] > 0, stats
    assert stats["spec_proposed_tokens"] >= stats["spec_accepted_tokens"]
    assert stats["num_preemptions"] > 0, "the run was to preempt"
    assert stats["num_steps"] < sum(len(t) for t in spec.values()), "no step yielded several tokens"
    assert stats["held_blocks"] == 0

    # A continued conversation: the prefix cache holds only accepted KV.
    first = spec["r1"]
    second = spec_engine.add_request(token_ids=[40, 41, 40, 41], request_id="r1", max_tokens=12, **GREEDY)
    run_all(spec_engine)
    assert second.prompt_token_ids == prompts["r1"] + first + [40, 41, 40, 41]
    assert second.tokens == hf_greedy(second.prompt_token_ids, 12)


def test_non_greedy_requests_do_not_speculate(tiny_engine):
    engine = tiny_engine(**SPEC)
    engine.add_request(token_ids=repetitive(1), request_id="s", max_tokens=10, temperature=0.8, seed=1, ignore_eos=True)
    run_all(engine)
    assert engine.stats()["spec_num_proposals"] == 0
