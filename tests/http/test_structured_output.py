"""Structured output and tool calling through bin/serve: the official ``openai`` client over
HTTP (``response_format``, vLLM's ``guided_*``, ``tools`` with ``tool_choice``, streamed and
not) and ``conveyor.client`` over ZeroMQ (``constraint``). The checkpoint is random, so only
the grammar mask makes an output parse and validate; every test ends with no KV held."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from conveyor.client import Client

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(tool_server):
    return tool_server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model(server) -> str:
    return client(server).models.list().data[0].id


def test_response_format_json_schema_always_validates(server) -> None:
    api, name = client(server), model(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        out = api.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": f"weather {seed}"}],
            response_format=fmt,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    chunks = api.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "streamed"}],
        response_format=fmt,
        temperature=1.0,
        seed=9,
        max_tokens=200,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = api.completions.create(
        model=name,
        prompt="an object",
        temperature=0.0,
        max_tokens=200,
        extra_body={"ignore_eos": True, "response_format": {"type": "json_object"}},
    )
    if obj.choices[0].finish_reason == "stop":  # json_object is unbounded: a random model may run out first
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:
        assert obj.choices[0].text.startswith("{")


def test_guided_fields_over_http_and_constraint_over_zmq(server) -> None:
    api, name = client(server), model(server)
    out = api.completions.create(
        model=name,
        prompt="date",
        temperature=1.0,
        seed=1,
        max_tokens=40,
        extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", out.choices[0].text)
    out = api.completions.create(
        model=name,
        prompt="pick",
        temperature=1.0,
        seed=2,
        max_tokens=40,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert out.choices[0].text in ("red", "green", "blue") and out.choices[0].finish_reason == "stop"
    with Client(server.address, timeout=60) as zmq:
        reply = zmq.generate(
            "pick", temperature=1.0, seed=3, max_tokens=40, constraint={"type": "choice", "choices": ["on", "off"]}
        )
        assert reply.text in ("on", "off") and reply.finish_reason == "stop"
        reply = zmq.generate(
            "n", temperature=1.0, seed=4, max_tokens=40, constraint={"type": "regex", "pattern": "[a-c]{3}x"}
        )
        assert re.fullmatch("[a-c]{3}x", reply.text)


def test_tool_choice_required_and_named_yield_tool_calls(server) -> None:
    api, name = client(server), model(server)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = api.chat.completions.create(
            model=name, messages=messages, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=5, max_tokens=200
        )
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            fn = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), fn)
        if choice != "required":
            assert [c.function.name for c in calls] == ["get_time"]
    chunks = list(
        api.chat.completions.create(
            model=name,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=6,
            max_tokens=200,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and all(json.loads(d.function.arguments) is not None for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # A tool's answer in the conversation, and the earlier call with null content.
    follow = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    out = api.chat.completions.create(model=name, messages=follow, tools=TOOLS, temperature=0, max_tokens=4)
    assert out.choices[0].message.content is not None


def test_hermes_parser_reads_calls_whole_and_streamed(server) -> None:
    """The output is forced into Hermes' format by a regex, so the --tool-call-parser path runs."""
    api, name = client(server), model(server)
    kw = dict(
        model=name,
        messages=[{"role": "user", "content": "time?"}],
        tools=TOOLS,
        temperature=1.0,
        seed=7,
        max_tokens=80,
        extra_body={"guided_regex": HERMES_CALL},
    )
    out = api.chat.completions.create(**kw)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    assert out.choices[0].finish_reason == "tool_calls" and not out.choices[0].message.content
    chunks = list(api.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_time"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "json_schema",
        ),
        ({"guided_regex": "([a-z]"}, "regex"),
        ({"guided_grammar": "start: foo("}, "grammar"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_constraint_is_a_400_naming_it(server, extra, named) -> None:
    api, name = client(server), model(server)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=extra
        )
    assert named in str(refused.value)


def test_n_choices_are_each_constrained_and_parsed_on_their_own(server) -> None:
    """n = 3 with a JSON schema, with a forcing tool_choice and with the Hermes parser: each
    choice is a single request's with seed + i (its own grammar state), validates, and has its
    own calls and finish_reason, whole and streamed."""
    api, name = client(server), model(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    kw = dict(
        model=name,
        messages=[{"role": "user", "content": "weather"}],
        response_format=fmt,
        temperature=1.0,
        max_tokens=200,
    )
    alone = [api.chat.completions.create(seed=20 + i, **kw).choices[0].message.content for i in range(3)]
    whole = api.chat.completions.create(seed=20, n=3, **kw)
    assert [c.message.content for c in whole.choices] == alone and len(set(alone)) > 1
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = ["", "", ""]
    for chunk in api.chat.completions.create(seed=20, n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == alone

    tools = dict(
        model=name,
        messages=[{"role": "user", "content": "weather?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        max_tokens=200,
    )
    single_calls = [
        [
            (t.function.name, t.function.arguments)
            for t in api.chat.completions.create(seed=30 + i, **tools).choices[0].message.tool_calls
        ]
        for i in range(3)
    ]
    out = api.chat.completions.create(seed=30, n=3, **tools)
    assert [
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in out.choices
    ] == single_calls
    assert [c.finish_reason for c in out.choices] == ["tool_calls"] * 3
    fns = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for calls in single_calls:
        for fn, arguments in calls:
            jsonschema.validate(json.loads(arguments), fns[fn])
    calls: dict[int, list] = {0: [], 1: [], 2: []}
    finish: dict[int, str] = {}
    for chunk in api.chat.completions.create(seed=30, n=3, stream=True, **tools):
        for c in chunk.choices:
            calls[c.index] += [(d.function.name, d.function.arguments) for d in c.delta.tool_calls or []]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [calls[i] for i in range(3)] == single_calls and finish == {
        0: "tool_calls",
        1: "tool_calls",
        2: "tool_calls",
    }

    hermes = dict(
        model=name,
        messages=[{"role": "user", "content": "time?"}],
        tools=TOOLS,
        temperature=1.0,
        max_tokens=80,
        extra_body={"guided_regex": HERMES_CALL},
    )
    zones = [
        json.loads(
            api.chat.completions.create(seed=40 + i, **hermes).choices[0].message.tool_calls[0].function.arguments
        )
        for i in range(2)
    ]
    out = api.chat.completions.create(seed=40, n=2, **hermes)
    assert [json.loads(c.message.tool_calls[0].function.arguments) for c in out.choices] == zones
    assert [c.finish_reason for c in out.choices] == ["tool_calls"] * 2
