"""Responses request bodies as chat jobs (conveyor.http.responses_requests), the response
object and events (conveyor.http.responses_output), and the reasoning budget's grammar
(conveyor.http.reasoning_budget): no server."""

from __future__ import annotations

import json

import pytest

from conveyor.client import CompletionResult, StreamDelta
from conveyor.client.connection import Usage
from conveyor.http.anthropic_requests import thinking_budget
from conveyor.http.errors import ApiError
from conveyor.http.openai_requests import CHAT, parse_request
from conveyor.http.output_reading import OutputReader
from conveyor.http.reasoning_budget import budgeted
from conveyor.http.responses_output import ResponseEvents, _Response, response_body
from conveyor.http.responses_requests import responses_job
from conveyor.http.tool_reading import ToolReader

MODEL = "m"


def test_input_items_become_chat_turns() -> None:
    body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "max_output_tokens": 9,
        "temperature": 0.5,
        "seed": 3,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    }
    parsed = responses_job(body, MODEL)
    turns = parsed.job.inputs[0]["messages"]
    assert [t["role"] for t in turns] == ["system", "system", "user", "assistant", "tool"]
    assert turns[2]["content"] == "Weather in Paris?"
    assert [c["function"]["arguments"] for c in turns[3]["tool_calls"]] == [{"city": "Paris"}, {}]
    assert turns[4] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert (
        parsed.job.options["max_tokens"] == 9
        and parsed.job.options["seed"] == 3
        and parsed.echo["instructions"] == "Be brief."
    )
    assert responses_job({"model": MODEL, "input": "hi"}, MODEL).job.options["fill_context"] is True
    prefill = responses_job(
        {"model": MODEL, "input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}, MODEL
    )
    assert prefill.job.options["continue_final_message"] is True


def test_tools_choice_and_text_format() -> None:
    tool = {"type": "function", "name": "get", "parameters": {"type": "object"}}
    job = responses_job(
        {
            "model": MODEL,
            "input": "x",
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "get"},
            "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}, "strict": True}},
        },
        MODEL,
    ).job
    assert job.options["tools"] == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert job.forced_tool_choice == {"type": "function", "function": {"name": "get"}}
    assert job.options["constraint"] == {"type": "json_schema", "schema": {"type": "object"}, "strict": True}
    ignored = responses_job(
        {"model": MODEL, "input": "x", "store": False, "metadata": {}, "reasoning": {"effort": "low"}, "zzz": 1}, MODEL
    )
    assert ignored.job.ignored == ("metadata", "reasoning", "zzz")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"instructions": 5}, "instructions"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_output_tokens": "many"}, "max_output_tokens"),
    ],
)
def test_bad_bodies_name_the_field(body, param) -> None:
    with pytest.raises(ApiError) as info:
        responses_job({"model": MODEL, "input": "hi", **body}, MODEL)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def result(text: str, finish: str = "stop") -> CompletionResult:
    return CompletionResult("r", text, [1] * 3, finish, Usage(7, 3))


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_streamed_items_reasoning_text_and_a_call_then_a_failure() -> None:
    reader = OutputReader("qwen3", ToolReader(None, "hermes"))
    text = '<think>\nhm\n</think>\n\nOK <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    whole = response_body(_Response("resp_1", MODEL, {}), result(text), reader)
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call"] and whole[
        "status"
    ] == "completed"
    enc = ResponseEvents(_Response("resp_1", MODEL, {}), reader)
    enc.start()
    for k in range(0, len(text), 5):
        enc(0, StreamDelta("r", text[k : k + 5], [1]))
    assert enc(0, StreamDelta("r", "", [], "stop", result(text))) == 1
    enc.end()
    got = _events(bytes(enc.out))
    assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
    added = [d["item"]["type"] for k, d in got if k == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"] and got[-1][0] == "response.completed"
    assert [i["type"] for i in got[-1][1]["response"]["output"]] == ["reasoning", "message", "function_call"]
    assert [{**i, "call_id": None} for i in got[-1][1]["response"]["output"]] == [
        {**i, "call_id": None} for i in whole["output"]
    ]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 0  # the think tags' ids unknown
    # With the tags' ids: the tokens between them, whole and in the stream's last event.
    ids = [4096, 7, 8, 4097, 9, 9, 9]
    counted = OutputReader("qwen3", ToolReader(None, "hermes"), (4096, 4097))
    done = CompletionResult("r", text, ids, "stop", Usage(7, 7))
    whole = response_body(_Response("resp_3", MODEL, {}, counted), done, counted)
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    enc = ResponseEvents(_Response("resp_3", MODEL, {}, counted), counted)
    enc.start()
    enc(0, StreamDelta("r", text, ids, "stop", done))
    enc.end()
    assert _events(bytes(enc.out))[-1][1]["response"]["usage"] == whole["usage"]
    # An empty think block: an empty reasoning item, whole and streamed alike.
    empty = CompletionResult("r", "<think></think>Hi", [4096, 4097, 9], "stop", Usage(7, 3))
    whole = response_body(_Response("resp_5", MODEL, {}, counted), empty, counted)
    enc = ResponseEvents(_Response("resp_5", MODEL, {}, counted), counted)
    enc.start()
    enc(0, StreamDelta("r", empty.text, empty.token_ids, "stop", empty))
    enc.end()
    streamed = _events(bytes(enc.out))[-1][1]["response"]["output"]
    assert [(i["type"], i["content"][0]["text"]) for i in streamed] == [("reasoning", ""), ("message", "Hi")]
    assert [{**i, "id": None} for i in streamed] == [{**i, "id": None} for i in whole["output"]]
    no_block = CompletionResult("r", "plain", [4096, 4097], "stop", Usage(7, 2))  # ids alone say nothing
    assert response_body(_Response("resp_4", MODEL, {}, counted), no_block, counted)["usage"][
        "output_tokens_details"
    ] == {"reasoning_tokens": 0}
    enc = ResponseEvents(_Response("resp_2", MODEL, {}), None)
    enc.start()
    enc(0, StreamDelta("r", "par", [1]))
    enc.fail(ApiError(503, "a process died", code="server_stopping"))
    kinds = [k for k, _ in _events(bytes(enc.out))]
    assert kinds[-5:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]


def test_reasoning_budget_grammar_and_its_refusals() -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    plain = parse_request(CHAT, chat, MODEL)
    grammar = budgeted(plain, 5, "qwen3").options["constraint"]["grammar"]
    assert (
        grammar.startswith("start: <think> thought </think> answer")
        and "max_tokens=5" in grammar
        and "<[*]>*" in grammar
    )
    assert budgeted(plain, 5, "deepseek_r1").options["constraint"]["grammar"].startswith("start: thought </think>")
    shaped = parse_request(CHAT, {**chat, "response_format": {"type": "json_object"}}, MODEL)
    assert "%json" in budgeted(shaped, 5, "qwen3").options["constraint"]["grammar"]
    assert budgeted(plain, None, None) is plain
    forced = parse_request(
        CHAT,
        {
            **chat,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": "required",
        },
        MODEL,
    )
    grammar_job = parse_request(CHAT, {**chat, "guided_grammar": 'start: "a"'}, MODEL)
    off = parse_request(CHAT, {**chat, "chat_template_kwargs": {"enable_thinking": False}}, MODEL)
    for job_, budget, parser in (
        (off, 5, "qwen3"),
        (plain, 5, None),
        (plain, "5", "qwen3"),
        (plain, -1, "qwen3"),
        (forced, 5, "qwen3"),
        (grammar_job, 5, "qwen3"),
    ):
        with pytest.raises(ApiError) as info:
            budgeted(job_, budget, parser)
        assert (info.value.status, info.value.param) == (400, "max_reasoning_tokens"), info.value.message
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 9},
    }
    assert thinking_budget(body) == 9 and thinking_budget({**body, "thinking": {"type": "disabled"}}) is None
