"""The engine's text is the server's: the demo model's greedy output (random weights, varied
text) read through the engine, against what the streaming protocol promises a client of
bin/serve (docs/protocol.md; frontend/stop.py's invariants): the text is the output's full
decode, cut before the earliest stop string, ending at the token that completes it; no delta
ever shows what the final text lacks; a request a stop string ended is aborted at the
scheduler at once."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, run_all

PROMPT = "The history of the printing press"


def decoded(tokenizer, prompt_ids: list[int], tokens: list[int]) -> str:
    """The output's text by the full decode: what the whole context decodes to past the prompt."""
    return tokenizer.decode(prompt_ids + tokens)[len(tokenizer.decode(prompt_ids)) :]


def streamed(engine, request) -> list[str]:
    """Step until ``request`` is done; its text deltas as a streaming client gets them."""
    deltas = []
    while not request.done:
        engine.step()
        deltas.append(request.take_new().text)
    return deltas


@pytest.fixture(scope="module")
def baseline(demo_engine):
    """The prompt's greedy output without stop strings: (prompt ids, tokens, text)."""
    request = demo_engine.add_request(PROMPT, max_tokens=48, **GREEDY)
    deltas = streamed(demo_engine, request)
    assert "".join(deltas) == request.text
    request.remove()
    return request.prompt_token_ids, request.tokens, request.text


def test_text_is_the_full_decode(demo_engine, baseline):
    prompt_ids, tokens, text = baseline
    tok = demo_engine.tokenizer
    assert prompt_ids == tok.encode(PROMPT)
    assert text == decoded(tok, prompt_ids, tokens)
    assert len(tokens) == 48 and len(set(tokens)) > 3, "too little text to cut"


def stop_strings_in(text: str) -> list[str]:
    """Substrings of ``text`` to stop at, in order: printable, not at its start, no
    replacement characters."""
    found = []
    for start in range(1, len(text) - 3):
        s = text[start : start + 3]
        if s.isprintable() and "\ufffd" not in s and s.strip() and text.find(s) > 0:
            found.append(s)
    return found


@pytest.mark.parametrize("pick", ["middle", "non-ascii", "two"])
def test_stop_strings_cut_the_text_as_the_server_does(demo_engine, baseline, pick):
    prompt_ids, tokens, text = baseline
    tok = demo_engine.tokenizer
    candidates = stop_strings_in(text)
    middle = next(s for s in candidates if text.find(s) >= len(text) // 3)
    if pick == "middle":
        stop = [middle]
    elif pick == "non-ascii":  # a character of several bytes, which tokens may split
        stop = [next(s for s in candidates if not s.isascii())]
    else:  # a later-starting stop string listed first: the earliest match in the text wins
        stop = [candidates[-1], middle]
        assert text.find(candidates[-1]) > text.find(middle)
    cut = min(text.find(s) for s in stop)
    # The output ends at the very token that completes the stop string.
    completing = next(
        n for n in range(1, len(tokens) + 1) if any(s in decoded(tok, prompt_ids, tokens[:n]) for s in stop)
    )

    request = demo_engine.add_request(PROMPT, max_tokens=48, stop=stop, **GREEDY)
    deltas = streamed(demo_engine, request)
    assert request.finish_reason == "stop"
    assert request.text == text[:cut]
    assert request.tokens == tokens[:completing]
    shown = ""
    for delta in deltas:
        shown += delta
        assert text[:cut].startswith(shown), "a delta showed text the final text lacks"
    assert shown == request.text
    # Aborted at the scheduler the moment it stopped: nothing runs, its blocks are free.
    stats = demo_engine.stats()
    assert stats["num_running"] == 0 and stats["held_blocks"] == 0
    request.remove()


def test_a_continued_text_prompt_gets_no_bos(demo_engine):
    tok = demo_engine.tokenizer
    first = demo_engine.add_request(PROMPT, request_id="turns", max_tokens=6, **GREEDY)
    run_all(demo_engine)
    second = demo_engine.add_request(" and then", request_id="turns", max_tokens=6, **GREEDY)
    assert second.prompt_token_ids == first.prompt_token_ids + first.tokens + tok.encode(
        " and then", add_special_tokens=False
    )
    run_all(demo_engine)
    assert second.num_cached_tokens > 0
    assert second.text == decoded(tok, second.prompt_token_ids, second.tokens)
    second.remove()


def test_messages_go_through_the_chat_template(demo_engine):
    tok = demo_engine.tokenizer
    chat = [{"role": "user", "content": "Name a colour."}]
    first = demo_engine.add_request(messages=chat, request_id="chat", max_tokens=4, **GREEDY)
    assert first.prompt_token_ids == tok.apply_chat_template(chat)
    run_all(demo_engine)
    more = [{"role": "user", "content": "Another."}]
    second = demo_engine.add_request(messages=more, request_id="chat", max_tokens=4, **GREEDY)
    # A continuation's template output loses its leading BOS (it follows earlier tokens).
    assert second.prompt_token_ids == first.prompt_token_ids + first.tokens + tok.apply_chat_template(more)[1:]
    run_all(demo_engine)
    second.remove()


def test_tools_count_toward_the_size_checked_before_rendering(demo_engine):
    """Issue 43: a large ``tools`` list behind a short message is refused by its size before
    the chat template renders it, as the server's frontend does (and stop_token_ids by count)."""
    import time

    from conveyor.protocol import wire

    tool = {"type": "function", "function": {"name": "f", "description": "x" * 1000, "parameters": {"type": "object"}}}
    chat = [{"role": "user", "content": "hi"}]
    start = time.monotonic()
    with pytest.raises(wire.ProtocolError, match="with tools") as refused:
        demo_engine.add_request(messages=chat, tools=[tool] * 2000, max_tokens=1)
    assert refused.value.code == wire.PROMPT_TOO_LONG and time.monotonic() - start < 1.0
    with pytest.raises(wire.ProtocolError, match="stop_token_ids"):
        demo_engine.add_request(PROMPT, stop_token_ids=[1] * 1025, max_tokens=1)
    assert not demo_engine.has_pending_requests()
