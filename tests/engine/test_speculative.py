"""Speculative decoding (n-gram proposer, rejection sampling) through the engine: greedy output
with speculation equals greedy without it and HF transformers' token for token, on the
position-sensitive tiny checkpoint, through chunked prefill, recompute preemption and a
continued conversation, with prompts that repeat text so that proposals are accepted; sampled
requests speculate too and keep their seeded streams (tests/worker/test_speculative_verify.py
checks the distributions)."""

from __future__ import annotations

import numpy as np

from tests.engine.conftest import GREEDY, run_all

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, ngram_max=3, ngram_min=1)


def repetitive(i: int) -> list[int]:
    """A prompt that repeats a short phrase, so its suffix recurs earlier in it."""
    phrase = [(7 * i + 3 * j) % 250 + 5 for j in range(3 + i % 3)]
    return phrase * 4 + phrase[:2]


def _serve(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    requests = {
        rid: engine.add_request(token_ids=p, request_id=rid, max_tokens=max_tokens, **GREEDY)
        for rid, p in prompts.items()
    }
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


SAMPLED = [  # (temperature, top_k, top_p, min_p): the sampler's filters, each on a seeded request
    (0.3, 0, 1.0, 0.0),
    (0.5, 40, 1.0, 0.0),
    (0.3, 0, 0.9, 0.0),
    (0.4, 0, 1.0, 0.05),
    (0.2, 8, 0.95, 0.0),
]


def _sampled(engine, extra: dict[str, dict]) -> dict[str, object]:
    """Seeded sampled requests (``SAMPLED``) on the repetitive prompts, and ``extra`` ones."""
    requests = {}
    for i, (temperature, top_k, top_p, min_p) in enumerate(SAMPLED):
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=11 * i + 1)
        requests[f"s{i}"] = engine.add_request(
            token_ids=repetitive(i), request_id=f"s{i}", max_tokens=24, ignore_eos=True, **sampling
        )
    for rid, fields in extra.items():
        requests[rid] = engine.add_request(request_id=rid, ignore_eos=True, **fields)
    run_all(engine)
    return requests


def test_sampled_speculation_keeps_the_distribution_and_the_seeded_stream(tiny_engine, hf_greedy):
    """Rejection sampling (worker/speculative_verify.py): a seeded request's n-gram-verified
    stream is the plain one (the acceptance is coupled to the plain draw), through every
    filter; top-k 1 at temperature 1 is greedy (the filters come from the sampler); an
    unseeded request runs; stop ids and max_tokens hold inside multi-token steps."""
    config = dict(max_batch_size=8, max_batch_tokens=32)
    extra = {
        "topk1": dict(token_ids=repetitive(2), max_tokens=16, temperature=1.0, top_k=1),
        "unseeded": dict(token_ids=repetitive(3), max_tokens=17, temperature=0.2),
        "greedy": dict(token_ids=repetitive(4), max_tokens=16, temperature=0.0),  # (the general rule's point masses)
    }
    spec_engine = tiny_engine(**config, **SPEC)
    spec = _sampled(spec_engine, extra)
    stats = spec_engine.stats()
    plain = _sampled(tiny_engine(**config), {})
    for i in range(len(SAMPLED)):
        assert spec[f"s{i}"].tokens == plain[f"s{i}"].tokens, i
        assert spec[f"s{i}"].finish_reason == "length" and len(spec[f"s{i}"].tokens) == 24
    assert spec["topk1"].tokens == hf_greedy(repetitive(2), 16)
    assert spec["greedy"].tokens == hf_greedy(repetitive(4), 16)
    assert len(spec["unseeded"].tokens) == 17 and spec["unseeded"].finish_reason == "length"
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats  # accepts and rejects
    assert stats["num_steps"] < sum(len(r.tokens) for r in spec.values()), "no step yielded several tokens"
    assert stats["held_blocks"] == 0

    # A stop id: the seeded stream ends at its first occurrence (the tokens after it in a
    # multi-token step are dropped).
    tokens = plain["s0"].tokens
    cut = next(k for k in range(4, len(tokens)) if tokens[k] not in tokens[:k])
    engine = tiny_engine(**SPEC)
    stopped = engine.add_request(
        token_ids=repetitive(0), request_id="stop", max_tokens=24, temperature=0.3, seed=1, stop_token_ids=[tokens[cut]]
    )
    run_all(engine)
    assert stopped.finish_reason == "stop" and stopped.tokens == tokens[: cut + 1]


def test_a_request_opts_out_with_speculate_false(tiny_engine):
    for speculate, speculated in ((True, True), (False, False)):
        engine = tiny_engine(**SPEC)
        engine.add_request(token_ids=repetitive(1), request_id="r", max_tokens=10, speculate=speculate, **GREEDY)
        run_all(engine)
        assert (engine.stats()["spec_num_proposals"] > 0) == speculated, speculate
