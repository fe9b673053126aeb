"""Tool-call parsing, whole and streamed in arbitrary chunks, and tool_choice enforcement."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.structured import Constraint, ConstraintError
from conveyor.structured.tool_calls import ToolCallDelta, ToolCallParser, parse_tool_calls
from conveyor.structured.tool_choice import constrained_tool_calls, tool_choice_constraint
from tests.structured.conftest import generate_batch

WEATHER = {"city": "Paris", "units": "celsius"}
CASES = [
    # (format, text, expected content, expected calls [(name, args)])
    ("hermes", "plain answer, no call", "plain answer, no call", []),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": '
        '"celsius"}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": '
        '1}"}</tool_call> done',
        " done",
        [("a", {}), ("b", {"x": 1})],
    ),
    ("hermes", "<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", []),
    ("hermes", 'cut off <tool_call>{"name": "a", "arguments": {"k": 2}}', "cut off ", [("a", {"k": 2})]),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "units": "celsius"}}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": [1]}}',
        "",
        [("a", {}), ("b", {"y": [1]})],
    ),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("llama3", '{"not": "a call"}', '{"not": "a call"}', []),
]


def _calls(delta: ToolCallDelta) -> list[tuple[str, dict]]:
    assert [c["index"] for c in delta.tool_calls] == list(range(len(delta.tool_calls)))
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in delta.tool_calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in delta.tool_calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_text(fmt, text, content, calls) -> None:
    delta = parse_tool_calls(text, fmt)
    assert delta.content == content and _calls(delta) == calls


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_in_any_chunks_equals_whole(case, cuts) -> None:
    fmt, text, content, calls = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parser = ToolCallParser(fmt)
    deltas = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [parser.finish()]
    merged = ToolCallDelta("".join(d.content for d in deltas), [c for d in deltas for c in d.tool_calls])
    assert merged.content == content and _calls(merged) == calls


def test_content_is_released_before_the_call_ends() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Sure, <tool").content == "Sure, "
    assert parser.feed('_call>{"name": "a", "argu').content == ""
    done = parser.feed('ments": {}}</tool_call>')
    assert _calls(done) == [("a", {})]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "units": {"enum": ["c", "f"]}},
                "required": ["city", "units"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_choice_is_enforced_on_a_random_model(compiler, tool_choice) -> None:
    compiled = compiler.compile(tool_choice_constraint(TOOLS, tool_choice))
    for text in generate_batch([compiled] * 4, seed=7, max_tokens=600):
        calls = constrained_tool_calls(text, tool_choice)
        assert calls
        for call in calls:
            name = call["function"]["name"]
            assert tool_choice == "required" or name == "add"
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])


def test_tool_choice_errors() -> None:
    assert tool_choice_constraint(TOOLS, "auto") is None and tool_choice_constraint(TOOLS, "none") is None
    assert isinstance(tool_choice_constraint(TOOLS, "required"), Constraint)
    with pytest.raises(ConstraintError, match="no tool named 'nope'"):
        tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ConstraintError, match="needs at least one tool"):
        tool_choice_constraint([], "required")
    with pytest.raises(ConstraintError, match=r"tools\[0\]: needs a function with a name"):
        tool_choice_constraint([{"type": "function", "function": {}}], "required")
    with pytest.raises(ConstraintError, match="tool_choice:"):
        tool_choice_constraint(TOOLS, "sometimes")
