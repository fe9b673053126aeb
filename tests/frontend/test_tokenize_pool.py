"""The frontend's tokenizer pool: long prompts are tokenized off the event loop, and a request
whose prompt is still tokenizing keeps every invariant of frontend/server.py (one final per
request, nothing reaches the scheduler for a request finalized meanwhile, unique ids,
continuation sessions). A live frontend loop runs on a thread against a stand-in scheduler
(conftest.py: ``live_frontend``); ``GatedTokenizer`` holds pooled encodes until the test opens
its gate, so every ordering below is forced, not raced."""

from __future__ import annotations

import time

import pytest

from conveyor.ipc.messages import AbortRequests, AddRequest, RequestOutput, TokenOutputs
from conveyor.runtime.config import FrontendConfig
from tests.frontend.conftest import GatedTokenizer

LONG = "The lighthouse keeper wrote in his log every night. " * 8  # 416 characters: pooled at 100
SHORT = "Hello there"


def generate(fe, sock, rid: str, prompt: str, **fields) -> None:
    fe.send(sock, type="generate", request_id=rid, prompt=prompt, max_tokens=1000, stream=True, **fields)


def finish(sid: str, token: int) -> TokenOutputs:
    return TokenOutputs([RequestOutput(sid, [token], finish_reason="length")])


def admit(fe, sock, rid: str, prompt: str = SHORT) -> AddRequest:
    """Submit ``rid``; the AddRequest the scheduler got (its ``request_id`` is the scheduler's id)."""
    generate(fe, sock, rid, prompt)
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest) and add.request_id != rid
    return add


@pytest.mark.parametrize("threads", [0, 2], ids=["inline", "pool"])
def test_streams_in_both_modes(live_frontend, ours, threads) -> None:
    # tokenize_inline_chars=0 sends every prompt through the pool's GIL-releasing encode
    fe = live_frontend(tokenizer_threads=threads, tokenize_inline_chars=0)
    sock = fe.client()
    add = admit(fe, sock, "a", LONG)
    assert add.prompt_token_ids == ours["demo"].encode(LONG)
    fe.scheduler_send(fe.first_token(add.request_id, 300))
    assert fe.recv(sock)["token_ids"] == [300]
    fe.scheduler_send(TokenOutputs([], [add.request_id], [301]))
    assert fe.recv(sock)["token_ids"] == [301]
    fe.scheduler_send(finish(add.request_id, 302))
    msgs = fe.until_final(sock)
    assert [m["type"] for m in msgs] == ["delta", "final"]
    assert msgs[-1]["token_ids"] == [300, 301, 302] and msgs[-1]["finish_reason"] == "length"
    assert msgs[-1]["usage"]["prompt_tokens"] == len(add.prompt_token_ids)
    assert msgs[-1]["text"] == ours["demo"].decode([300, 301, 302])


def test_other_streams_flow_while_a_long_prompt_tokenizes(live_frontend, gated, ours) -> None:
    fe = live_frontend(gated, tokenize_inline_chars=100)
    streaming, waiting = fe.client(), fe.client()
    s = admit(fe, streaming, "s").request_id
    generate(fe, waiting, "long", LONG)
    assert gated.entered.wait(5)  # "long" is now stuck in the pool, mid-tokenization
    fe.scheduler_send(fe.first_token(s, 300))
    gaps = []
    for i in range(20):
        sent = time.monotonic()
        if i:
            fe.scheduler_send(TokenOutputs([], [s], [300 + i]))
        msg = fe.recv(streaming)
        assert msg is not None and msg["type"] == "delta" and msg["token_ids"] == [300 + i]
        gaps.append(time.monotonic() - sent)
    # Inline, the loop would be stuck in encode() until the gate opened: no delta at all.
    assert max(gaps) < 2.0
    assert fe.scheduler_recv(timeout=0.05) is None  # nothing about "long" before its tokens exist
    assert fe.frontend.in_flight[fe.key(waiting, "long")].pending
    assert set(fe.frontend.requests) == {s}  # admitted ones only
    gated.gate.set()
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest) and add.request_id not in ("long", s)
    assert add.prompt_token_ids == ours["demo"].encode(LONG)
    fe.scheduler_send(finish(add.request_id, 400))
    msgs = fe.until_final(waiting)
    assert [m["type"] for m in msgs] == ["delta", "final"] and msgs[-1]["token_ids"] == [400]
    assert msgs[-1]["usage"]["prompt_tokens"] == len(add.prompt_token_ids)


def test_abort_while_tokenizing_sends_nothing_to_the_scheduler_and_one_final(live_frontend, gated, ours) -> None:
    fe = live_frontend(gated, tokenize_inline_chars=100)
    sock = fe.client()
    generate(fe, sock, "x", LONG)
    assert gated.entered.wait(5)
    fe.send(sock, type="abort", request_id="x")
    msgs = fe.until_final(sock)
    assert [m["type"] for m in msgs] == ["final"]
    assert msgs[0]["finish_reason"] == "abort" and msgs[0]["token_ids"] == [] and msgs[0]["usage"]["prompt_tokens"] == 0
    fe.send(sock, type="abort", request_id="x")  # idempotent: nothing more
    gated.gate.set()
    assert fe.wait_for(lambda: not fe.frontend.intake.tokenizing)  # the pool handed its tokens back
    assert fe.scheduler_recv(timeout=0.3) is None  # neither an AddRequest nor an AbortRequests
    assert fe.recv(sock, timeout=0.3) is None  # and no second final
    assert not fe.frontend.requests and not fe.frontend.in_flight
    # the id is free again, and the next request under it is served normally
    add = admit(fe, sock, "x")
    fe.scheduler_send(finish(add.request_id, 300))
    assert [m["type"] for m in fe.until_final(sock)] == ["delta", "final"]


def test_disconnect_while_tokenizing_sends_nothing_to_the_scheduler(live_frontend, gated, ours) -> None:
    fe = live_frontend(gated, tokenize_inline_chars=100)
    other = fe.client()
    admit(fe, other, "stays")
    gone = fe.client()
    generate(fe, gone, "gone", LONG)
    assert gated.entered.wait(5)
    gone_key = fe.key(gone, "gone")
    gone.close(linger=0)
    assert fe.wait_for(lambda: gone_key not in fe.frontend.in_flight)  # the disconnect was handled
    gated.gate.set()
    assert fe.wait_for(lambda: not fe.frontend.intake.tokenizing)
    assert fe.scheduler_recv(timeout=0.3) is None
    assert list(fe.frontend.in_flight) == [fe.key(other, "stays")] and len(fe.frontend.requests) == 1


def test_disconnect_after_admission_aborts_at_the_scheduler(live_frontend) -> None:
    fe = live_frontend(tokenize_inline_chars=100)
    gone = fe.client()
    adds = [admit(fe, gone, "pooled", LONG), admit(fe, gone, "inline", SHORT)]
    gone.close(linger=0)
    abort = fe.scheduler_recv()
    assert isinstance(abort, AbortRequests) and sorted(abort.request_ids) == sorted(a.request_id for a in adds)


def test_duplicate_id_is_refused_while_its_prompt_tokenizes(live_frontend, gated, ours) -> None:
    fe = live_frontend(gated, tokenize_inline_chars=100)
    sock = fe.client()
    generate(fe, sock, "d", LONG)
    assert gated.entered.wait(5)
    generate(fe, sock, "d", SHORT)
    refused = fe.recv(sock)  # an error map, not a final: the one final under "d" stays the running request's
    assert (refused["type"], refused["request_id"], refused["code"]) == ("error", "d", "duplicate_request_id")
    assert "already in flight" in refused["message"]
    gated.gate.set()
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest) and add.prompt_token_ids == ours["demo"].encode(LONG)
    assert fe.scheduler_recv(timeout=0.2) is None  # the duplicate never went anywhere
    fe.scheduler_send(finish(add.request_id, 300))
    assert [m["type"] for m in fe.until_final(sock)] == ["delta", "final"]


def test_outputs_for_an_id_still_tokenizing_are_ignored(live_frontend, gated) -> None:
    """Outputs under the client's id, or the id its request will have at the scheduler, cannot
    reach a pending one (tests/frontend/test_request_ids.py: late outputs of an earlier request)."""
    fe = live_frontend(gated, tokenize_inline_chars=100)
    sock = fe.client()
    generate(fe, sock, "p", LONG)
    assert gated.entered.wait(5)
    pending = fe.frontend.in_flight[fe.key(sock, "p")]
    for rid in ("p", pending.scheduler_id):
        fe.scheduler_send(TokenOutputs([], [rid], [300]))
        fe.scheduler_send(finish(rid, 301))
    assert fe.recv(sock, timeout=0.3) is None
    gated.gate.set()
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest) and add.request_id == pending.scheduler_id
    fe.scheduler_send(finish(add.request_id, 302))
    msgs = fe.until_final(sock)
    assert msgs[-1]["token_ids"] == [302]


def test_shutdown_while_tokenizing_sends_one_error_final(live_frontend, gated, ours) -> None:
    fe = live_frontend(gated, tokenize_inline_chars=100)
    sock = fe.client()
    generate(fe, sock, "z", LONG)
    assert gated.entered.wait(5)
    fe.shutdown()
    msgs = fe.until_final(sock)
    assert [m["type"] for m in msgs] == ["final"]
    assert msgs[0]["finish_reason"] == "error" and msgs[0]["error"] == "test over"
    gated.gate.set()  # the pool thread finishes; its tokens go nowhere
    assert fe.scheduler_recv(timeout=0.3) is None
    assert fe.recv(sock, timeout=0.2) is None


def test_tokenize_error_in_the_pool_is_one_error_final(live_frontend) -> None:
    fe = live_frontend(tokenize_inline_chars=100, max_model_len=64)
    sock = fe.client()
    generate(fe, sock, "big", LONG)
    msgs = fe.until_final(sock)
    assert [m["type"] for m in msgs] == ["final"]
    assert msgs[0]["finish_reason"] == "error" and "the model's limit is 64" in msgs[0]["error"]
    assert fe.scheduler_recv(timeout=0.2) is None and not fe.frontend.requests


def test_pooled_continuation_and_an_abort_while_tokenizing_keep_the_context(live_frontend, gated, ours) -> None:
    tok = ours["demo"]
    fe = live_frontend(gated, tokenize_inline_chars=100)
    sock = fe.client()
    first = admit(fe, sock, "chat")
    fe.scheduler_send(finish(first.request_id, 300))
    assert fe.until_final(sock)[-1]["finish_reason"] == "length"
    context = first.prompt_token_ids + [300]
    # a long continuation, aborted while it tokenizes: the earlier context stays as it was
    generate(fe, sock, "chat", LONG)
    assert gated.entered.wait(5)
    fe.send(sock, type="abort", request_id="chat")
    assert fe.until_final(sock)[-1]["finish_reason"] == "abort"
    assert fe.frontend.sessions.context(fe.key(sock, "chat")) == context
    gated.gate.set()
    assert fe.wait_for(lambda: not fe.frontend.intake.tokenizing)
    assert fe.scheduler_recv(timeout=0.2) is None
    # the retry continues the same context, its text without BOS
    generate(fe, sock, "chat", LONG)
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest)
    assert add.prompt_token_ids == context + tok.encode(LONG, add_special_tokens=False)
    assert fe.frontend.sessions.context(fe.key(sock, "chat")) is None  # back, extended, when this turn finishes
    assert add.request_id != first.request_id
    fe.scheduler_send(finish(add.request_id, 301))
    final = fe.until_final(sock)[-1]
    assert final["token_ids"] == [301] and final["usage"]["prompt_tokens"] == len(add.prompt_token_ids)
    assert fe.frontend.sessions.context(fe.key(sock, "chat")) == add.prompt_token_ids + [301]


def test_chat_messages_over_the_threshold_are_pooled(live_frontend, gated, ours) -> None:
    fe = live_frontend(gated, tokenize_inline_chars=100)
    sock = fe.client()
    messages = [{"role": "user", "content": LONG}]
    fe.send(sock, type="generate", request_id="m", messages=messages, max_tokens=4)
    assert gated.entered.wait(5)
    gated.gate.set()
    add = fe.scheduler_recv()
    assert add.prompt_token_ids == ours["demo"].apply_chat_template(messages)
    counters = {c.name: c.total for c in fe.frontend.profiler.snapshot(60).counters}
    assert counters["pooled_tokenizations"] == 1


def test_config_rejects_negative_pool_settings() -> None:
    from conveyor.ipc.transport import ServerAddresses

    addrs = ServerAddresses.in_run_dir("/tmp/x", "ipc:///tmp/x/c")
    with pytest.raises(ValueError, match="tokenizer_threads"):
        FrontendConfig("d", addrs, max_model_len=8, vocab_size=8, tokenizer_threads=-1)
    with pytest.raises(ValueError, match="tokenize_inline_chars"):
        FrontendConfig("d", addrs, max_model_len=8, vocab_size=8, tokenize_inline_chars=-1)


# ---------------------------------------------------------------------- a frontend that fell behind

WORDS = " one two three four on a"  # one token per word in the demo vocabulary


def test_inline_tokenization_stalls_streams_and_queued_steps_are_merged(live_frontend, gated, ours) -> None:
    """tokenizer_threads=0 (everything on the loop): a prompt being tokenized holds every
    stream. The steps that queued up meanwhile then go out as one delta per stream."""
    tok = ours["demo"]
    words = tok.encode(WORDS, add_special_tokens=False)
    assert len(words) == 6 and tok.decode(words) == WORDS
    gated.gate_inline = False
    fe = live_frontend(gated, tokenizer_threads=0)
    streaming, blocking = fe.client(), fe.client()
    s = admit(fe, streaming, "s").request_id
    fe.scheduler_send(fe.first_token(s, words[0]))
    assert fe.recv(streaming)["token_ids"] == words[:1]
    gated.gate_inline = True
    generate(fe, blocking, "b", SHORT)
    assert gated.entered.wait(5)  # the event loop itself is now inside encode()
    for token in words[1:5]:
        fe.scheduler_send(TokenOutputs([], [s], [token]))
    assert fe.recv(streaming, timeout=0.3) is None  # stalled: nothing moves while it tokenizes
    gated.gate.set()
    assert isinstance(fe.scheduler_recv(), AddRequest)
    merged = fe.recv(streaming)
    assert merged["type"] == "delta" and merged["token_ids"] == words[1:5]
    assert merged["text"] == tok.decode(words[1:5])
    fe.scheduler_send(finish(s, words[5]))
    msgs = fe.until_final(streaming)
    assert msgs[-1]["token_ids"] == words and msgs[-1]["text"] == WORDS
    series = {s.name: s.values for s in fe.frontend.profiler.snapshot(60, series=["merged_steps"]).series}
    assert series["merged_steps"] == [4]


def test_merged_steps_stop_at_the_token_that_completes_a_stop_string(live_frontend, gated, ours) -> None:
    tok = ours["demo"]
    words = tok.encode(WORDS, add_special_tokens=False)
    fe = live_frontend(gated, tokenizer_threads=0)
    streaming, blocking = fe.client(), fe.client()
    generate(fe, streaming, "s", SHORT, stop=" four")
    add = fe.scheduler_recv()
    assert isinstance(add, AddRequest)
    s = add.request_id
    gated.gate_inline = True
    generate(fe, blocking, "b", SHORT)
    assert gated.entered.wait(5)
    fe.scheduler_send(fe.first_token(s, words[0]))
    for token in words[1:]:
        fe.scheduler_send(TokenOutputs([], [s], [token]))
    gated.gate.set()
    assert isinstance(fe.scheduler_recv(), AddRequest)  # "b"
    abort = fe.scheduler_recv()  # the stop string ended "s" here: the scheduler is told
    assert isinstance(abort, AbortRequests) and abort.request_ids == [s]
    msgs = fe.until_final(streaming)
    final = msgs[-1]
    assert final["finish_reason"] == "stop" and final["text"] == " one two three"
    assert final["token_ids"] == words[:4]  # up to the token that completed " four", not beyond
    assert "".join(m["text"] for m in msgs[:-1]) == final["text"]
    assert [t for m in msgs[:-1] for t in m["token_ids"]] == words[:4]


def test_merge_keeps_step_order_first_timings_and_stops_at_a_finish() -> None:
    from conveyor.frontend.output import merge

    batch = [
        TokenOutputs(
            [RequestOutput("a", [1], scheduled_time=5.0, first_token_time=6.0, num_cached_tokens=3)], ["b"], [10]
        ),
        TokenOutputs([], ["a", "b"], [2, 11]),
        TokenOutputs(
            [RequestOutput("b", [12], finish_reason="length"), RequestOutput("c", [20], first_token_time=7.0)],
            ["a"],
            [3],
        ),
    ]
    merged = {out.request_id: out for out in merge(batch)}
    assert merged["a"].new_token_ids == [1, 2, 3] and merged["a"].finish_reason is None
    assert (merged["a"].scheduled_time, merged["a"].first_token_time, merged["a"].num_cached_tokens) == (5.0, 6.0, 3)
    assert merged["b"].new_token_ids == [10, 11, 12] and merged["b"].finish_reason == "length"
    assert merged["c"].new_token_ids == [20] and merged["c"].first_token_time == 7.0


class LargeGatedTokenizer(GatedTokenizer):
    """Holds only the encodes of inputs of LARGE_INPUT_CHARS or more until ``gate`` is set."""

    def encode(self, text: str, add_special_tokens: bool = True, *, release_gil: bool = False) -> list[int]:
        from conveyor.frontend.intake import LARGE_INPUT_CHARS

        if len(text) >= LARGE_INPUT_CHARS:
            return super().encode(text, add_special_tokens, release_gil=release_gil)
        return self._base.encode(text, add_special_tokens, release_gil=release_gil)


def test_a_large_input_does_not_hold_up_ordinary_pooled_ones(live_frontend, ours) -> None:
    """With one ordinary pool thread, a large input (its own thread) still tokenizing does not
    keep a shorter pooled input from being admitted."""
    from conveyor.frontend.intake import LARGE_INPUT_CHARS

    gated = LargeGatedTokenizer(ours["demo"])
    try:
        fe = live_frontend(gated, tokenize_inline_chars=100, tokenizer_threads=1, max_model_len=1_000_000)
        sock = fe.client()
        large = "word " * (LARGE_INPUT_CHARS // 5 + 1)
        generate(fe, sock, "large", large)
        assert gated.entered.wait(5)  # stuck on the large-input thread
        medium = admit(fe, sock, "medium", LONG)  # pooled (over tokenize_inline_chars), admitted at once
        assert medium.prompt_token_ids == ours["demo"].encode(LONG)
        assert fe.frontend.in_flight[fe.key(sock, "large")].pending
        gated.gate.set()
        add = fe.scheduler_recv()
        assert isinstance(add, AddRequest) and add.prompt_token_ids == ours["demo"].encode(large)
    finally:
        gated.gate.set()


@pytest.mark.parametrize("turn", ["first", "continuation"])
def test_an_input_too_long_for_the_model_is_refused_before_it_is_tokenized(live_frontend, ours, turn) -> None:
    """Characters over max_model_len x max_chars_per_token (less the earlier turns' tokens) cannot
    fit: refused with ``prompt_too_long`` without an encode (every encode here would block)."""
    tok = ours["demo"]
    fe = live_frontend(max_model_len=64)
    sock = fe.client()
    history = 0
    if turn == "continuation":
        fe.send(sock, type="generate", request_id="r", prompt=SHORT, max_tokens=4)
        first = fe.scheduler_recv()
        assert isinstance(first, AddRequest)
        fe.scheduler_send(finish(first.request_id, 300))
        fe.until_final(sock)
        history = len(first.prompt_token_ids) + 1
    gated = GatedTokenizer(tok, gate_inline=True)  # from here on, any encode blocks the frontend
    fe.frontend.tokenizer = gated
    limit = (64 - history) * tok.max_chars_per_token
    fe.send(sock, type="generate", request_id="r", prompt="x" * (limit + 1), max_tokens=4)
    refused = fe.recv(sock)
    assert (refused["type"], refused["request_id"], refused["finish_reason"]) == ("final", "r", "error")
    assert refused["code"] == "prompt_too_long" and f"at most {limit} characters" in refused["error"]
    assert not gated.entered.is_set() and fe.scheduler_recv(timeout=0.1) is None
    gated.gate.set()


def test_max_chars_per_token_bounds_every_token_of_every_test_vocabulary(ours) -> None:
    """No token's text (decoded alone, or after another token, where a decoder may add a space)
    is longer than max_chars_per_token: the premise of refusing long inputs untokenized."""
    for name, tok in ours.items():
        bound = tok.max_chars_per_token
        a = tok.encode("a", add_special_tokens=False)
        for token in range(tok.vocab_size):
            alone = tok.decode([token], skip_special_tokens=False)
            after = tok.decode([*a, token], skip_special_tokens=False)[len(tok.decode(a, skip_special_tokens=False)) :]
            assert max(len(alone), len(after)) <= bound, (name, token, alone, after, bound)
