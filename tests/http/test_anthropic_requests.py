"""The Messages API's translation and answers without a server: bodies -> the chat job they
mean, the stop-sequence tail, the streamed events of synthetic deltas (text, a forced tool
call, a failure), error bodies, Anthropic's ``x-api-key``, and the request-id rules."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import make_mocked_request

from conveyor.client import CompletionResult, StreamDelta
from conveyor.client.connection import Usage
from conveyor.http import request_ids
from conveyor.http.anthropic_requests import messages_job
from conveyor.http.anthropic_responses import MessageEvents, StopTail, error_body, message_body
from conveyor.http.app import Access
from conveyor.http.errors import ApiError
from conveyor.http.output_reading import OutputReader, output_reader

MODEL = "tiny"
TOOL = {
    "name": "get_time",
    "description": "d",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}},
}


def job(**body):
    return messages_job(
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}, MODEL
    )


def test_bodies_become_the_chat_request_they_mean() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "utc"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12:00"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                {"type": "text", "text": "thanks"},
            ],
        },
        {"role": "assistant", "content": "Sure"},
    ]
    j = job(
        system=[{"type": "text", "text": "sys"}],
        messages=messages,
        stop_sequences=["END"],
        temperature=0.5,
        top_k=3,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        metadata={"user_id": "u"},
        stream=True,
    )
    turns = j.inputs[0]["messages"]
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "tool", "user", "assistant"]
    assert turns[1]["content"] == "ab" and turns[2]["content"] == "calling"
    assert turns[2]["tool_calls"] == [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}
    ]
    assert (turns[3]["tool_call_id"], turns[3]["content"], turns[4]["content"]) == ("toolu_1", "12:00", "Error: boom")
    o = j.options
    assert (o["max_tokens"], o["stop"], o["include_stop_str_in_output"], o["temperature"], o["top_k"]) == (
        8,
        ["END"],
        True,
        0.5,
        3,
    )
    assert (
        o["add_generation_prompt"] is False and o["continue_final_message"] is True
    )  # the last assistant turn: a prefill
    assert o["tools"] == [
        {"type": "function", "function": {"name": "get_time", "parameters": TOOL["input_schema"], "description": "d"}}
    ]
    assert j.forced_tool_choice == {"type": "function", "function": {"name": "get_time"}} and j.stream
    assert j.ignored == ("metadata", "tool_choice.disable_parallel_tool_use") and "fill_context" not in o
    assert job(tool_choice={"type": "any"}, tools=[TOOL]).forced_tool_choice == "required"
    assert job(tool_choice={"type": "none"}, tools=[TOOL]).tools is False
    assert "tool_choice" not in job(tool_choice={"type": "auto"}).options  # no tools: nothing to choose
    unknown = job(foo=1)
    assert unknown.unknown == ("foo",) and unknown.ignored == ("foo",)
    with pytest.raises(ApiError) as info:
        messages_job(
            {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "foo": 1},
            MODEL,
            strict=True,
        )
    assert info.value.param == "foo"
    counted = messages_job({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, MODEL, count_only=True)
    assert "max_tokens" not in counted.options


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": "no"}]}
                ]
            },
            "messages",
        ),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"tools": [{"name": "f"}]}, "tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config"),
        ({"model": 5}, "model"),
    ],
)
def test_bad_bodies_name_the_field(body, param) -> None:
    with pytest.raises(ApiError) as info:
        job(**body)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def result(text: str, finish: str = "stop") -> CompletionResult:
    return CompletionResult("r", text, [1] * 3, finish, Usage(7, 3))


def test_stop_tail_and_the_unstreamed_message() -> None:
    tail = StopTail(["END", "xy"])  # the longest stop's length is held back
    assert (tail.feed("abcEN"), tail.feed("D"), tail.finish("stop")) == ("ab", "c", ("", "END"))
    tail = StopTail(["END"])
    assert (tail.feed("hello E"), tail.feed("ND"), tail.finish("stop")) == ("hell", "o ", ("", "END"))
    tail = StopTail(["END"])
    assert (tail.feed("hi"), tail.finish("stop")) == ("", ("hi", None))
    tail = StopTail(["END"])
    assert tail.feed("hello END") + tail.finish("length")[0] == "hello END"  # cut by length: not a stop
    body = message_body("msg_1", MODEL, result("fine END"), ["END"], None)
    assert body["content"] == [{"type": "text", "text": "fine "}] and (body["stop_reason"], body["stop_sequence"]) == (
        "stop_sequence",
        "END",
    )
    assert body["usage"] == {"input_tokens": 7, "output_tokens": 3}
    assert message_body("m", MODEL, result("a", "length"), None, None)["stop_reason"] == "max_tokens"
    assert message_body("m", MODEL, result("a"), None, None)["stop_reason"] == "end_turn"
    forced = output_reader(job(tools=[TOOL], tool_choice={"type": "any"}), None, None)
    body = message_body("m", MODEL, result('[{"name": "get_time", "arguments": {"zone": "cet"}}]'), None, forced)
    assert (
        body["stop_reason"] == "tool_use"
        and body["content"][0]["input"] == {"zone": "cet"}
        and body["content"][0]["type"] == "tool_use"
    )


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_streamed_events_of_text_a_stop_a_call_and_a_failure() -> None:
    enc = MessageEvents("msg_1", MODEL, ["END"], None)
    enc.start()
    for piece in ("he", "llo E", "ND"):
        enc(0, StreamDelta("r", piece, [1]))
    assert enc(0, StreamDelta("r", "", [], "stop", result("hello END"))) == 1
    enc.end()
    got = events(bytes(enc.out))
    assert [k for k, _ in got] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(d["delta"]["text"] for k, d in got if k == "content_block_delta") == "hello "
    assert (
        got[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
        and got[-2][1]["usage"]["input_tokens"] == 7
    )
    forced = output_reader(job(tools=[TOOL], tool_choice={"type": "tool", "name": "get_time"}), None, None)
    enc = MessageEvents("msg_2", MODEL, None, forced)
    enc.start()
    enc(0, StreamDelta("r", '{"zone": ', [1]))
    enc(0, StreamDelta("r", '"utc"}', [1], "stop", result('{"zone": "utc"}')))
    got = events(bytes(enc.out))
    assert [k for k, _ in got][2:] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
    ]
    assert got[2][1]["content_block"]["type"] == "tool_use" and got[2][1]["content_block"]["input"] == {}
    assert (
        json.loads(got[3][1]["delta"]["partial_json"]) == {"zone": "utc"}
        and got[-1][1]["delta"]["stop_reason"] == "tool_use"
    )
    # tool_choice auto with --tool-call-parser hermes: text first, then the parsed call as its own block.
    parsed = output_reader(job(tools=[TOOL]), "hermes", None)
    enc = MessageEvents("msg_4", MODEL, None, parsed)
    enc.start()
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    for piece in ("Let me check. ", call[:20], call[20:]):
        enc(0, StreamDelta("r", piece, [1]))
    enc(0, StreamDelta("r", "", [], "stop", result("Let me check. " + call)))
    got = events(bytes(enc.out))
    blocks = [d["content_block"] for k, d in got if k == "content_block_start"]
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and blocks[1]["name"] == "get_time"
    assert "".join(d["delta"].get("text", "") for k, d in got if k == "content_block_delta").strip() == "Let me check."
    assert [d["index"] for k, d in got if k == "content_block_stop"] == [0, 1] and got[-1][1]["delta"][
        "stop_reason"
    ] == "tool_use"
    whole = message_body("m", MODEL, result("Let me check. " + call), None, parsed)
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"] and whole["content"][1]["input"] == {
        "zone": "cet"
    }
    # With a reasoning parser too: the thinking block, then the call read from what follows it.
    thought = "<think>\nI should check.\n</think>\n\n" + call
    both = output_reader(job(tools=[TOOL]), "hermes", "qwen3")
    whole = message_body("m", MODEL, result(thought), None, both)
    assert [b["type"] for b in whole["content"]] == ["thinking", "tool_use"] and whole["stop_reason"] == "tool_use"
    enc = MessageEvents("msg_5", MODEL, None, both)
    enc.start()
    for k in range(0, len(thought), 7):
        enc(0, StreamDelta("r", thought[k : k + 7], [1]))
    enc(0, StreamDelta("r", "", [], "stop", result(thought)))
    got = events(bytes(enc.out))
    assert [d["content_block"]["type"] for k, d in got if k == "content_block_start"] == ["thinking", "tool_use"]
    assert got[-1][1]["delta"]["stop_reason"] == "tool_use"
    enc = MessageEvents("msg_3", MODEL, None, None)
    enc.start()
    enc(0, StreamDelta("r", "partial", [1]))
    enc.fail(ApiError(503, "a process died"))
    got = events(bytes(enc.out))
    assert [k for k, _ in got][-2:] == ["content_block_stop", "error"]
    assert got[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "a process died"}}
    assert error_body(ApiError(400, "bad"))["error"]["type"] == "invalid_request_error"
    assert error_body(ApiError(500, "bug"))["error"]["type"] == "api_error"


def test_anthropic_routes_take_x_api_key_and_request_ids_are_safe() -> None:
    access = Access.of(["k1"])
    assert access.allows(make_mocked_request("POST", "/v1/messages", headers={"x-api-key": "k1"}))
    assert not access.allows(make_mocked_request("POST", "/v1/messages", headers={"x-api-key": "k2"}))
    assert not access.allows(
        make_mocked_request("POST", "/v1/chat/completions", headers={"x-api-key": "k1"})
    )  # OpenAI routes: Bearer
    assert access.allows(make_mocked_request("POST", "/v1/messages", headers={"Authorization": "Bearer k1"}))
    for given, used in (("abc-1", "abc-1"), ("a" * 129, None), ("x y", None), ("é", None)):
        request = make_mocked_request("GET", "/", headers={"x-request-id": given})
        request_ids.assign(request)
        assert request_ids.request_id(request) == used if used else len(request_ids.request_id(request)) == 32


def test_thinking_blocks_whole_and_streamed() -> None:
    """With --reasoning-parser, the think block is a thinking block before the text, whole and streamed."""
    reader = OutputReader("qwen3", None)
    text = "<think>\nThe user greets me.\n</think>\n\nHello there"
    body = message_body("m", MODEL, result(text), None, reader)
    assert body["content"] == [
        {"type": "thinking", "thinking": "The user greets me.", "signature": ""},
        {"type": "text", "text": "Hello there"},
    ]
    enc = MessageEvents("m", MODEL, None, reader)
    enc.start()
    for piece in ("<thi", "nk>\nThe user", " greets me.\n</th", "ink>\n\nHello", " there"):
        enc(0, StreamDelta("r", piece, [1]))
    enc(0, StreamDelta("r", "", [], "stop", result(text)))
    got = events(bytes(enc.out))
    blocks = [(d["index"], d["content_block"]["type"]) for k, d in got if k == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text")]
    assert (
        "".join(d["delta"].get("thinking", "") for k, d in got if k == "content_block_delta") == "The user greets me."
    )
    assert "".join(d["delta"].get("text", "") for k, d in got if k == "content_block_delta") == "Hello there"
    # Anthropic's order: the thinking block's deltas, its signature, its stop, then the text block.
    kinds = [(k, d.get("delta", {}).get("type")) for k, d in got]
    at = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[at + 1 : at + 3] == [("content_block_stop", None), ("content_block_start", None)]
    assert {t for _, t in kinds[:at] if t} == {"thinking_delta"} and got[at][1]["index"] == 0
    # An empty think block is an empty thinking block, whole and streamed alike.
    empty = "<think></think>Hi"
    assert message_body("m", MODEL, result(empty), None, reader)["content"][0] == {
        "type": "thinking",
        "thinking": "",
        "signature": "",
    }
    enc = MessageEvents("m", MODEL, None, reader)
    enc.start()
    enc(0, StreamDelta("r", empty, [1], "stop", result(empty)))
    got = events(bytes(enc.out))
    assert [d["content_block"]["type"] for k, d in got if k == "content_block_start"] == ["thinking", "text"]
    assert messages_job(
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"},
        },
        MODEL,
    ).options["chat_template_kwargs"] == {"enable_thinking": False}
