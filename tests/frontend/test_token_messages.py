"""``tokenize`` and ``detokenize`` (docs/protocol.md): the frontend tokenizes for the HTTP
process, with a generate's ids, bounds and refusals; a large input is tokenized off the event
loop, so other clients are answered meanwhile; nothing reaches the scheduler."""

from __future__ import annotations

import uuid

from conveyor.client import Client, ServerError


def ask(fe, sock, **fields) -> dict:
    rid = uuid.uuid4().hex
    fe.send(sock, request_id=rid, **fields)
    reply = fe.recv(sock)
    assert reply is not None and reply["request_id"] == rid, reply
    return reply


def test_tokenize_gives_the_ids_a_generate_runs_on(live_frontend, ours) -> None:
    tok = ours["demo"]
    fe = live_frontend()
    sock = fe.client()
    reply = ask(fe, sock, type="tokenize", prompt="Hello there, world")
    assert reply["type"] == "tokens" and reply["token_ids"] == tok.encode("Hello there, world"), reply
    assert reply["max_model_len"] == 4096 and "token_strs" not in reply
    bare = ask(fe, sock, type="tokenize", prompt="Hello there, world", add_special_tokens=False, return_token_strs=True)
    assert bare["token_ids"] == tok.encode("Hello there, world", add_special_tokens=False)
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["token_ids"])
    chat = [{"role": "user", "content": "Hi"}]
    assert ask(fe, sock, type="tokenize", messages=chat)["token_ids"] == tok.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert (
        ask(fe, sock, type="tokenize", prompt="a b c d e f", truncate_prompt_tokens=2)["token_ids"]
        == tok.encode("a b c d e f")[-2:]
    )
    assert fe.scheduler_recv(timeout=0.2) is None  # nothing of it reached the scheduler


def test_tokenize_refusals_are_a_generates(live_frontend) -> None:
    fe = live_frontend(max_model_len=64)
    sock = fe.client()
    long = ask(fe, sock, type="tokenize", prompt="x" * 100_000)
    assert (
        long["type"] == "error"
        and long["code"] == "prompt_too_long"
        and "cannot fit the model length 64" in long["message"]
    ), long
    fe.send(sock, request_id="g", type="generate", prompt="x" * 100_000)
    final = fe.recv(sock)
    assert final["type"] == "final" and final["error"] == long["message"]  # the very words of a generate's refusal
    for fields, code in (
        (dict(prompt=3), "invalid_field"),
        (dict(prompt="a", max_tokens=3), "invalid_field"),  # a generate field that shapes no input
        (dict(prompt="a", add_special_tokens="no"), "invalid_field"),
        (dict(), "invalid_field"),
    ):
        reply = ask(fe, sock, type="tokenize", **fields)
        assert reply["type"] == "error" and reply["code"] == code, (fields, reply)
    fe.send(sock, type="tokenize", prompt="a")  # no id: answered all the same (an error map without one)
    reply = fe.recv(sock)
    assert reply["type"] == "error" and reply["request_id"] is None and "request_id" in reply["message"]


def test_detokenize(live_frontend, ours) -> None:
    tok = ours["demo"]
    fe = live_frontend()
    sock = fe.client()
    ids = tok.encode("Hello there")
    reply = ask(fe, sock, type="detokenize", token_ids=ids)
    assert reply["type"] == "text" and reply["text"] == tok.decode(ids, skip_special_tokens=False), reply
    bad = ask(fe, sock, type="detokenize", token_ids=[1, tok.vocab_size])
    assert bad["type"] == "error" and bad["code"] == "invalid_input" and f"token id {tok.vocab_size}" in bad["message"]
    assert ask(fe, sock, type="detokenize", token_ids=["a"])["code"] == "invalid_field"


def test_a_large_tokenize_runs_off_the_loop(live_frontend, gated, ours) -> None:
    fe = live_frontend(gated, tokenize_inline_chars=100)
    big, small = fe.client(), fe.client()
    fe.send(big, request_id="big", type="tokenize", prompt="word " * 400)
    assert gated.entered.wait(5)  # held mid-tokenization on a pool thread
    reply = ask(fe, small, type="detokenize", token_ids=[1, 2])  # the loop still answers
    assert reply["type"] == "text"
    assert fe.recv(big, timeout=0.2) is None
    gated.gate.set()
    assert fe.recv(big)["token_ids"] == ours["demo"].encode("word " * 400)


def test_the_client_calls(live_frontend, ours) -> None:
    fe = live_frontend()
    with Client(fe.addresses.client) as client:
        assert client.tokenize("Hello")["token_ids"] == ours["demo"].encode("Hello")
        assert client.detokenize(ours["demo"].encode("Hello", add_special_tokens=False))["text"] == "Hello"
        try:
            client.detokenize([-1])
        except ServerError as exc:
            assert exc.code == "invalid_input"
        else:
            raise AssertionError("an id outside the vocabulary was decoded")


def test_a_final_carries_the_prompt_ids_when_asked(live_frontend, ours) -> None:
    """``return_prompt_token_ids``: what the HTTP face asks instead of tokenizing the prompt again."""
    from conveyor.ipc.messages import AddRequest, RequestOutput, TokenOutputs

    fe = live_frontend()
    sock = fe.client()
    for rid, asked in (("with", True), ("without", False)):
        fe.send(
            sock, type="generate", request_id=rid, prompt="Hello there", max_tokens=1, return_prompt_token_ids=asked
        )
        add = fe.scheduler_recv()
        while not isinstance(add, AddRequest):
            add = fe.scheduler_recv()
        fe.scheduler_send(TokenOutputs([RequestOutput(add.request_id, [7], finish_reason="length")]))
        final = fe.until_final(sock)[-1]
        assert final.get("prompt_token_ids") == (ours["demo"].encode("Hello there") if asked else None), final
