"""conveyor.Engine on the tiny random Llama (CPU), driven like the seeds' loops: requests added
between steps, removed mid-generation, continued by id, priorities, an offline batch. Every
token is checked against transformers' greedy generate of the same context (``hf_greedy``);
every mechanism is checked to have happened through the scheduler's own stats and the
iterations' batch metadata."""

from __future__ import annotations

import time

import pytest

from conveyor.engine.options import EngineOptions
from conveyor.protocol import requests as client_requests
from conveyor.protocol import validation, wire
from tests.engine.conftest import GREEDY, run_all

SYSTEM = [5, 17, 29, 41, 53, 65, 77, 89]


def prompt(i: int) -> list[int]:
    own = [(31 * i + 7 * j) % 150 + 3 for j in range(3 + 4 * i)]
    return SYSTEM + own if i % 2 == 0 else own


def test_requests_added_between_steps_match_hf(tiny_engine, hf_greedy):
    engine = tiny_engine(max_batch_size=3, max_batch_tokens=16)
    max_tokens = {i: 6 + i for i in range(5)}
    requests, streamed, batches = {}, {}, []

    def add(i: int) -> None:
        requests[i] = engine.add_request(token_ids=prompt(i), request_id=f"r{i}", max_tokens=max_tokens[i], **GREEDY)
        streamed[i] = []

    def step() -> None:
        out = engine.step()
        batches.append(out.batch)
        for request in out.requests:
            streamed[int(request.request_id[1:])] += request.take_new().token_ids

    add(0)
    add(1)
    step()
    add(2)
    add(3)
    step()
    step()
    add(4)
    while engine.has_pending_requests():
        step()
    for i, request in requests.items():
        assert request.done and request.finish_reason == "length", request
        assert request.tokens == hf_greedy(prompt(i), max_tokens[i]), i
        assert streamed[i] == request.tokens, i
        assert not request.has_available_tokens()
    assert all(b.input_tokens <= 16 and b.batch_size <= 3 for b in batches)
    assert any(b.prefill_tokens and b.decode_tokens for b in batches), "no prefill ran beside decodes"
    assert sum(b.num_admitted for b in batches) == 5
    stats = engine.stats()
    assert stats["held_blocks"] == 0 and stats["num_running"] == stats["num_waiting"] == 0


def test_remove_mid_generation_frees_its_blocks_at_once(tiny_engine, hf_greedy):
    engine = tiny_engine()
    long = engine.add_request(token_ids=prompt(4), request_id="long", max_tokens=40, **GREEDY)
    other = engine.add_request(token_ids=prompt(1), request_id="other", max_tokens=12, **GREEDY)
    for _ in range(4):
        engine.step()
    before = engine.stats()
    assert before["num_running"] == 2
    taken = long.tokens
    assert 0 < len(taken) < 40
    long.remove()
    after = engine.stats()
    assert long.done and long.finish_reason == "abort"
    assert after["num_running"] == 1
    assert after["held_blocks"] < before["held_blocks"]
    run_all(engine)
    assert long.tokens == taken  # nothing after the removal
    assert other.tokens == hf_greedy(prompt(1), 12)
    assert engine.stats()["held_blocks"] == 0
    # A removed request is forgotten: its id starts a new request.
    again = engine.add_request(token_ids=[7, 8, 9], request_id="long", max_tokens=3, **GREEDY)
    assert again.prompt_token_ids == [7, 8, 9]
    long.remove()  # an earlier request under the id: no effect on the new one
    assert not again.done
    run_all(engine)
    assert again.tokens == hf_greedy([7, 8, 9], 3)


def test_continued_by_id_reuses_the_kv_and_matches_hf(tiny_engine, hf_greedy):
    engine = tiny_engine()
    first = engine.add_request(token_ids=prompt(2), request_id="chat", max_tokens=7, **GREEDY)
    run_all(engine)
    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    second = engine.add_request(token_ids=[11, 12, 13], request_id="chat", max_tokens=5, **GREEDY)
    context = prompt(2) + first.tokens
    assert second.prompt_token_ids == context + [11, 12, 13]
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(token_ids=[1, 2], request_id="chat")
    run_all(engine)
    # The earlier turns' KV came from the prefix cache: only the last output and the new
    # input ran (as the frontend's sessions, tests/e2e/test_scheduler_model.py).
    assert second.num_cached_tokens == len(context) - 1
    assert engine.stats()["prefix_cache_hit_tokens"] - hits_before == len(context) - 1
    assert second.tokens == hf_greedy(second.prompt_token_ids, 5)
    assert first.tokens == hf_greedy(prompt(2), 7)
    first.remove()  # superseded by the second turn: does not forget the conversation
    third = engine.add_request(token_ids=[21], request_id="chat", max_tokens=2, **GREEDY)
    assert third.prompt_token_ids == second.prompt_token_ids + second.tokens + [21]
    third.remove()  # aborts it and forgets the conversation
    assert third.finish_reason == "abort" and not engine.has_pending_requests()
    fresh = engine.add_request(token_ids=[21], request_id="chat", max_tokens=2, **GREEDY)
    assert fresh.prompt_token_ids == [21]


def test_validation_errors_are_the_servers(tiny_engine):
    engine = tiny_engine(max_waiting=1)
    vocab, max_len = engine.model_config.vocab_size, engine.max_model_len

    def server_error(fields: dict, ids: list[int] | None = None) -> str:
        """What the server answers (protocol parse, then the tokenized context's rules)."""
        try:
            req = client_requests.parse_client_message({"type": "generate", **fields})
            validation.check_tokenized(req, ids if ids is not None else list(req.token_ids), vocab, max_len)
        except wire.ProtocolError as exc:
            return str(exc)
        raise AssertionError(f"{fields} is valid")

    cases = [
        dict(token_ids=[1, 2], max_tokens=0),
        dict(token_ids=[1, 2], top_p=1.5),
        dict(token_ids=[1, 2], stop=[""]),
        dict(token_ids=[1, vocab + 5]),
        dict(token_ids=[3] * (max_len - 4), max_tokens=10),
        dict(token_ids=[1, 2], stop_token_ids=[-1]),
        dict(token_ids=[1, 2], priority=2**40),
        {},
    ]
    for fields in cases:
        with pytest.raises(ValueError) as caught:
            engine.add_request(**fields)
        assert str(caught.value) == server_error(fields), fields
    with pytest.raises(ValueError) as caught:
        engine.add_request(prompt="x", messages=[{"role": "user", "content": "y"}])
    assert str(caught.value) == server_error(dict(prompt="x", messages=[{"role": "user", "content": "y"}]))
    with pytest.raises(TypeError, match="stream"):
        engine.add_request(prompt="x", stream=True)
    assert not engine.has_pending_requests() and engine.stats()["num_waiting"] == 0
    # The scheduler's refusals are raised too (max_waiting=1: the queue is full).
    engine.add_request(token_ids=[1, 2], request_id="a")
    with pytest.raises(ValueError, match="overloaded"):
        engine.add_request(token_ids=[1, 2], request_id="b")
    # The refused id was never taken.
    run_all(engine)
    engine.add_request(token_ids=[1, 2], request_id="b", max_tokens=1)


def test_options_by_meaning_and_by_name(tiny_engine):
    engine = tiny_engine(
        max_batch_size=3,
        max_batch_tokens=32,
        min_batch_size=2,
        max_wait_ms=5,
        policy="priority",
        preemption="recompute",
    )
    cfg = engine.config
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.min_batch_size, cfg.max_wait_ms) == (3, 32, 2, 5)
    assert (cfg.policy, cfg.preemption, cfg.block_size, cfg.num_blocks, cfg.max_model_len) == (
        "priority",
        "recompute",
        4,
        128,
        256,
    )
    assert engine.runner.num_blocks == 128 and str(engine.runner.device) == "cpu"
    assert EngineOptions.from_kwargs({"max_num_seqs": 7}).scheduler == {"max_num_seqs": 7}
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineOptions.from_kwargs({"max_batch_size": 2, "max_num_seqs": 3})
    with pytest.raises(TypeError, match="num_blocks"):
        EngineOptions.from_kwargs({"num_blocks": 2})  # the pool is num_kv_blocks, as bin/serve's flag
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        tiny_engine(max_batch_size=0)
    with pytest.raises(ValueError, match="exceeds the model's 256"):
        tiny_engine(max_model_len=1000)


def test_batch_metadata(tiny_engine, hf_greedy):
    engine = tiny_engine(max_batch_tokens=64)
    idle = engine.step()
    assert idle.batch is None and idle.requests == []
    lens = [5, 9, 13]
    for i, n in enumerate(lens):
        engine.add_request(token_ids=list(range(3, 3 + n)), request_id=f"p{i}", max_tokens=4, **GREEDY)
    time.sleep(0.02)
    first = engine.step().batch
    assert (first.batch_size, first.num_admitted) == (3, 3)
    assert (first.prefill_tokens, first.decode_tokens, first.input_tokens) == (sum(lens), 0, sum(lens))
    assert 0.02 <= first.avg_wait <= first.max_wait < 5
    second = engine.step().batch
    assert (second.batch_size, second.num_admitted, second.input_tokens, second.decode_tokens) == (3, 0, 3, 3)
    assert second.avg_wait == second.max_wait == 0
    assert second.step == first.step + 1
    engine.add_request(token_ids=list(range(60, 67)), request_id="late", max_tokens=2, **GREEDY)
    third = engine.step().batch
    assert (third.batch_size, third.num_admitted, third.prefill_tokens, third.decode_tokens) == (4, 1, 7, 3)
    assert third.input_tokens == 10 and third.max_wait >= 0
    assert third.row["step"] == third.step and third.row["held_blocks"] > 0

    # The token budget cuts prefills into chunks; the chunks' positions and blocks continue
    # each other (transformers' tokens).
    small = tiny_engine(max_batch_tokens=8)
    chunked = small.add_request(token_ids=list(range(3, 23)), max_tokens=4, **GREEDY)
    chunks = [out.batch.input_tokens for out in run_all(small)]
    assert chunks[:3] == [8, 8, 4] and sum(chunks) == 20 + 3
    assert chunked.tokens == hf_greedy(list(range(3, 23)), 4)


def test_admission_gate_waits_for_company(tiny_engine):
    engine = tiny_engine(min_batch_size=3, max_wait_ms=100_000)
    for i in range(2):
        engine.add_request(token_ids=[3, 4, 5 + i], max_tokens=2, **GREEDY)
    out = engine.step()
    assert out.batch is None and out.requests == [] and engine.has_pending_requests()
    assert engine.seconds_until_ready() > 50
    engine.add_request(token_ids=[3, 4, 9], max_tokens=2, **GREEDY)
    assert engine.step().batch.num_admitted == 3

    alone = tiny_engine(min_batch_size=3, max_wait_ms=30)
    alone.add_request(token_ids=[3, 4, 5], max_tokens=2, **GREEDY)
    assert alone.step().batch is None
    time.sleep(alone.seconds_until_ready())
    batch = alone.step().batch
    assert batch.num_admitted == 1 and batch.max_wait >= 0.03


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priorities_order_admission(tiny_engine, policy):
    engine = tiny_engine(policy=policy, max_batch_size=1)
    for name, priority in (("low", 0), ("mid", 5), ("high", 10)):
        engine.add_request(token_ids=[3, 4, 5], request_id=name, priority=priority, max_tokens=2, **GREEDY)
    admitted = []
    for out in run_all(engine):
        if out.batch.num_admitted:
            admitted += [r.request_id for r in out.requests]
    assert admitted == (["high", "mid", "low"] if policy == "priority" else ["low", "mid", "high"])


def test_generate_returns_every_prompt_in_order(tiny_engine, hf_greedy):
    engine = tiny_engine(max_batch_size=2)
    prompts = [prompt(i % 4) for i in range(7)]
    prompts[3] = list(range(40, 52))
    prompts[5] = "A text prompt, tokenized with BOS"
    results = engine.generate(prompts, max_tokens=5, progress=False, **GREEDY)
    assert len(results) == len(prompts)
    assert len({r.request_id for r in results}) == len(prompts)
    for p, result in zip(prompts, results):
        assert result.prompt_token_ids == (engine.tokenizer.encode(p) if isinstance(p, str) else p)
        assert result.finish_reason == "length" and result.error is None
        assert result.token_ids == hf_greedy(result.prompt_token_ids, 5)
    assert any(r.num_cached_tokens for r in results), "repeated prompts took nothing from the prefix cache"
    assert not engine.has_pending_requests() and engine.stats()["held_blocks"] == 0
    # Removed at the end: an id does not continue.
    again = engine.add_request(token_ids=[4, 5], request_id=results[0].request_id, max_tokens=1)
    assert again.prompt_token_ids == [4, 5]
    again.remove()
    # A bad prompt: named, and nothing of the job is left running.
    with pytest.raises(ValueError, match=r"prompts\[2\]: 'token_ids' must contain only integers"):
        engine.generate([[3, 4], [5, 6], [1.5]], max_tokens=50, progress=False)
    assert not engine.has_pending_requests() and engine.stats()["held_blocks"] == 0


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_engine, hf_greedy, monkeypatch):
    engine = tiny_engine()
    doomed = engine.add_request(token_ids=prompt(1), max_tokens=4, **GREEDY)

    def fail(plan):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", fail)
    out = engine.step()
    assert out.requests == [doomed] and doomed.finish_reason == "error" and "device lost" in doomed.error
    monkeypatch.undo()
    assert engine.stats()["held_blocks"] == 0
    fine = engine.add_request(token_ids=prompt(1), max_tokens=4, **GREEDY)
    run_all(engine)
    assert fine.tokens == hf_greedy(prompt(1), 4)


def test_frontend_fields_through_the_engine(tiny_engine, hf_greedy):
    """The frontend's fields (shared code with bin/serve's frontend) on conveyor.Engine:
    truncation keeps the newest ids, fill_context runs to the model length, and a negative
    seed gives one reproducible stream."""
    engine = tiny_engine(max_model_len=40)
    ids = list(range(30, 50))
    result = engine.generate([ids], truncate_prompt_tokens=6, max_tokens=3, progress=False, **GREEDY)[0]
    assert result.prompt_token_ids == ids[-6:] and result.token_ids == hf_greedy(ids[-6:], 3)
    full = engine.generate([ids[:10]], fill_context=True, progress=False, **GREEDY)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 40 - 10
    sampled = [
        engine.generate([ids[:5]], seed=-7, max_tokens=6, temperature=1.0, progress=False)[0].token_ids
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]
