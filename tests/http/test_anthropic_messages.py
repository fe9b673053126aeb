"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through
bin/serve, with the official ``anthropic`` SDK unchanged and raw HTTP: the same answer as the
chat route on the same conversation (one request path), stop sequences, a forced tool call
(the checkpoint is random, so ``tool_choice`` and the constraint path make it), a tool_result
turn, the streamed event order, token counts and errors in Anthropic's shape. One server for
the module; it ends with no KV held."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

TOOLS = [
    {
        "name": "get_time",
        "description": "the time in a zone",
        "input_schema": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
    {
        "name": "get_weather",
        "input_schema": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["days"],
            "additionalProperties": False,
        },
    },
]
MESSAGES = [{"role": "user", "content": "what time is it?"}]
# The SDK of 2026 types no sampling fields; the Messages API still takes them (as extra_body sends them).
# Sampled requests are seeded: a random model's forced call is then the same on every run.
GREEDY, SAMPLED = {"temperature": 0}, {"temperature": 1.0, "seed": 5}


@pytest.fixture(scope="module")
def server(tool_server):
    return tool_server


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def model(server) -> str:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused").models.list().data[0].id


def post(server, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_text_answer_is_the_chat_answer_and_counts_match(server) -> None:
    api, name = client(server), model(server)
    system = "be brief"
    msg = api.messages.create(model=name, system=system, messages=MESSAGES, max_tokens=12, extra_body=GREEDY)
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").chat.completions.create(
        model=name, messages=[{"role": "system", "content": system}, *MESSAGES], max_tokens=12, extra_body=GREEDY
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == name
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    # count_tokens: the prompt the template renders, as the answer's usage counted it; system as text blocks too.
    counted = api.messages.count_tokens(model=name, system=[{"type": "text", "text": system}], messages=MESSAGES)
    assert counted.input_tokens == msg.usage.input_tokens
    with_tools = api.messages.count_tokens(model=name, system=system, messages=MESSAGES, tools=TOOLS)
    answered = api.messages.create(model=name, system=system, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert with_tools.input_tokens == answered.usage.input_tokens  # the prompt as the template renders it, tools too
    # output_config.format: the JSON-schema constraint, as the chat's response_format.
    schema = TOOLS[0]["input_schema"]
    out = api.messages.create(
        model=name,
        messages=MESSAGES,
        max_tokens=40,
        extra_body=SAMPLED,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert json.loads(out.content[0].text)["zone"] in ("utc", "cet") and out.stop_reason == "end_turn"


def test_stop_sequences_end_the_answer_and_are_named(server) -> None:
    api, name = client(server), model(server)
    full = api.messages.create(model=name, messages=MESSAGES, max_tokens=24, extra_body=GREEDY).content[0].text
    stop = full[6:8]
    assert len(full) >= 10 and stop.strip(), full
    expected = full[: full.index(stop)]
    msg = api.messages.create(
        model=name, messages=MESSAGES, max_tokens=24, extra_body=GREEDY, stop_sequences=["\x00never", stop]
    )
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == (expected, "stop_sequence", stop)
    with api.messages.stream(
        model=name, messages=MESSAGES, max_tokens=24, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    with api.messages.stream(model=name, messages=MESSAGES, max_tokens=24, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == full  # no stop sequence: nothing held back at the end


def test_forced_tool_calls_made_streamed_and_answered(server) -> None:
    api, name = client(server), model(server)
    msg = api.messages.create(
        model=name,
        messages=MESSAGES,
        max_tokens=60,
        tools=TOOLS,
        extra_body=SAMPLED,
        tool_choice={"type": "tool", "name": "get_time"},
    )
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    call = msg.content[0]
    assert call.name == "get_time" and call.input["zone"] in ("utc", "cet") and call.id.startswith("toolu_")
    # "any" may make several calls: room for them, as the chat route's "required" test gives.
    msg = api.messages.create(
        model=name, messages=MESSAGES, max_tokens=200, tools=TOOLS, extra_body=SAMPLED, tool_choice={"type": "any"}
    )
    assert msg.stop_reason == "tool_use" and msg.content and all(b.type == "tool_use" for b in msg.content)
    assert all(b.name in ("get_time", "get_weather") for b in msg.content)
    with api.messages.stream(
        model=name,
        messages=MESSAGES,
        max_tokens=60,
        tools=TOOLS,
        extra_body=SAMPLED,
        tool_choice={"type": "tool", "name": "get_time"},
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input["zone"] in ("utc", "cet")
    # The call and its result in the conversation: rendered as the chat's tool_calls and tool turns.
    follow = [
        *MESSAGES,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "12:00"},
                {"type": "text", "text": "and now?"},
            ],
        },
    ]
    answer = api.messages.create(
        model=name, messages=follow, max_tokens=4, tools=TOOLS, extra_body=GREEDY, tool_choice={"type": "none"}
    )
    assert answer.content[0].type == "text" and answer.usage.input_tokens > msg.usage.input_tokens


def test_raw_event_order(server) -> None:
    body = {"model": model(server), "messages": MESSAGES, "max_tokens": 5, "stream": True, "temperature": 0}
    status, headers, raw = post(server, "/v1/messages", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        events.append((kind[7:], json.loads(data[6:])))
    assert all(kind == data["type"] for kind, data in events)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] <= 5
    assert delta["usage"]["input_tokens"] > 0
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    unstreamed = json.loads(post(server, "/v1/messages", {**body, "stream": False})[2])
    assert text == unstreamed["content"][0]["text"] and unstreamed["usage"] == delta["usage"]


def test_errors_are_in_anthropic_shape(server) -> None:
    api, name = client(server), model(server)
    with pytest.raises(anthropic.BadRequestError) as info:
        api.messages.create(model=name, messages=MESSAGES, max_tokens=4, extra_body={"temperature": -1})
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        api.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert info.value.body["error"]["type"] == "not_found_error"
    cases = [
        ({"messages": MESSAGES}, "max_tokens"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "image"),
        ({"messages": MESSAGES, "max_tokens": 4, "tool_choice": {"type": "maybe"}}, "tool_choice"),
        ({"messages": MESSAGES, "max_tokens": 4, "thinking": {"type": "sometimes"}}, "thinking"),
        (
            {"messages": MESSAGES, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "server tools",
        ),
    ]
    for body, named in cases:
        status, _, raw = post(server, "/v1/messages", {"model": name, **body})
        reply = json.loads(raw)
        assert status == 400 and reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
        assert named in reply["error"]["message"], reply
    status, _, raw = post(server, "/v1/messages/nope", {})
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    # Ignored and unknown fields are accepted and named.
    status, headers, raw = post(
        server,
        "/v1/messages",
        {"model": name, "messages": MESSAGES, "max_tokens": 2, "metadata": {"user_id": "u"}, "container": "c"},
    )
    assert status == 200 and headers["x-conveyor-ignored-fields"] == "container,metadata"
