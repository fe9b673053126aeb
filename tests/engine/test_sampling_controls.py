"""Sampling controls through ``conveyor.Engine``, greedy, against transformers
(``hf_controlled``: HF's own logits processors where it has them, a float32 one from vLLM's
definition for the presence / frequency penalties). Under preemption (recompute and swap),
prefix-cache reuse and a continuation, where the device-side counts must be rebuilt right."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, run_all


def prompt(i: int, n: int = 9) -> list[int]:
    return [(7 * i + 3 * j) % 50 + 5 for j in range(n)]


CONTROLS = [
    dict(presence_penalty=-2.0, frequency_penalty=0.5),  # repeats each token 4 times: counts matter
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.7),
    dict(frequency_penalty=-1.0, repetition_penalty=1.3),
    dict(logit_bias={9: 4.0, 17: -100.0, 30: 3.5}),
]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_penalties_and_bias_match_hf_under_preemption(tiny_engine, hf_controlled, hf_greedy, preemption):
    """Six requests (one uncontrolled) share a prefix and a KV pool too small for them all:
    requests are preempted and resumed mid-output, and each still matches its reference."""
    engine = tiny_engine(num_kv_blocks=24, num_cpu_blocks=64, preemption=preemption, max_batch_tokens=24)
    shared = prompt(9, 8)
    requests = [
        engine.add_request(token_ids=shared + prompt(i, 3), max_tokens=24, **GREEDY, **controls)
        for i, controls in enumerate(CONTROLS)
    ]
    plain = engine.add_request(token_ids=shared + prompt(7, 3), max_tokens=24, **GREEDY)
    run_all(engine)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemptions"
    assert stats["prefix_cache_hit_tokens"] > 0
    for request, controls in zip(requests, CONTROLS):
        assert request.tokens == hf_controlled(request.prompt_token_ids, 24, **controls), controls
    assert plain.tokens == hf_greedy(plain.prompt_token_ids, 24)
    # The controls changed something: the references differ from the plain greedy text.
    changed = [
        hf_controlled(r.prompt_token_ids, 24, **c) != hf_greedy(r.prompt_token_ids, 24)
        for r, c in zip(requests, CONTROLS)
    ]
    assert all(changed), changed


def test_a_continuation_counts_its_whole_context_as_prompt(tiny_engine, hf_controlled):
    engine = tiny_engine()
    controls = dict(presence_penalty=2.0, repetition_penalty=1.5)
    first = engine.add_request(token_ids=prompt(3), request_id="chat", max_tokens=10, **GREEDY, **controls)
    run_all(engine)
    second = engine.add_request(token_ids=[11, 12], request_id="chat", max_tokens=10, **GREEDY, **controls)
    run_all(engine)
    assert second.num_cached_tokens > 0
    assert first.tokens == hf_controlled(prompt(3), 10, **controls)
    assert second.tokens == hf_controlled(second.prompt_token_ids, 10, **controls)


def test_min_tokens_holds_back_a_favoured_stop_token(tiny_engine, hf_controlled):
    """A +100 bias makes a stop token win every draw; ``min_tokens`` masks it (and EOS)
    until that many tokens are out, then the request stops on it."""
    engine = tiny_engine()
    eos = engine.model_config.eos_token_ids
    stop_id = 40
    fields = dict(temperature=0.0, logit_bias={stop_id: 100.0}, stop_token_ids=[stop_id], min_tokens=5)
    request = engine.add_request(token_ids=prompt(2), max_tokens=12, **fields)
    run_all(engine)
    expected = hf_controlled(prompt(2), 12, stop=[stop_id, *eos], logit_bias={stop_id: 100.0}, min_tokens=5)
    assert request.tokens == expected
    assert len(expected) == 6 and expected[-1] == stop_id and request.finish_reason == "stop"
    # Without min_tokens it stops at once.
    at_once = engine.add_request(token_ids=prompt(2), max_tokens=12, **{**fields, "min_tokens": 0})
    run_all(engine)
    assert at_once.tokens == [stop_id]


def test_min_tokens_defers_stop_strings(tiny_engine):
    """A stop string the output holds from its first token ends the request only once
    ``min_tokens`` tokens are out, as stop token ids do (the worker masks those)."""
    engine = tiny_engine()
    favoured = 40
    stop = engine.tokenizer.decode([favoured])
    assert stop.strip(), stop
    fields = dict(temperature=0.0, logit_bias={favoured: 100.0}, stop=[stop], ignore_eos=True)
    late = engine.add_request(token_ids=prompt(2), max_tokens=12, min_tokens=5, **fields)
    at_once = engine.add_request(token_ids=prompt(2), max_tokens=12, **fields)
    run_all(engine)
    assert at_once.tokens == [favoured] and at_once.text == "" and at_once.finish_reason == "stop"
    assert late.tokens == [favoured] * 6 and late.finish_reason == "stop"
    assert late.text == stop * 5


def test_bad_fields_are_refused(tiny_engine):
    engine = tiny_engine()
    vocab = engine.model_config.vocab_size
    for fields, needle in [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logit_bias={vocab: 1.0}), f"logit_bias token id {vocab} is outside the vocabulary"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "at most 1024"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens=20 exceeds max_tokens=10"),
        (dict(min_tokens=-1), "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=needle):
            engine.add_request(token_ids=[5, 6], **fields)
