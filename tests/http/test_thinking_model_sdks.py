"""The official ``openai`` and ``anthropic`` SDKs, unchanged, against one bin/serve --http-port on a
tiny Qwen3 whose chat template has a think block (tests/checkpoints.py), served with
``--reasoning-parser qwen3`` and ``--tool-call-parser hermes``: ``responses.create`` streamed and
not, a function tool round trip, ``text.format`` and ``responses.parse`` / ``chat.completions.parse``
with pydantic models, reasoning on chat and Responses with its token counts, and Anthropic's
``messages.create`` / ``messages.stream`` with thinking blocks and tools.

Random weights never write a think block, so the answers with reasoning are forced: vLLM's
``structured_outputs`` grammar makes the model write a known text, which the parsers then split,
or the reasoning budget's grammar makes it open the block (Messages' ``thinking.budget_tokens``).
"""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel

from conveyor.client import Client
from tests.checkpoints import THINKING_TOKENS
from tests.e2e.serve_harness import ServeProcess
from tests.http.conftest import SERVE_ARGS, http_serve, stop_and_check

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
THOUGHT = "<think>\nThe user greets me.\n</think>\n\nHello there"
CALL_AFTER_THOUGHT = (
    '<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>'
)


def forced(text: str) -> dict:
    """The body fields that make the model write ``text`` exactly (then stop): vLLM's
    ``structured_outputs`` grammar, the added tokens as themselves (a grammar names them as
    ``<think>``; spelled out as text they would be the characters, not the tokens)."""
    pieces = re.split("(" + "|".join(map(re.escape, THINKING_TOKENS)) + ")", text)
    return {
        "structured_outputs": {
            "grammar": "start: " + " ".join(p if p in THINKING_TOKENS else json.dumps(p) for p in pieces if p)
        }
    }


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory):
    from tests.checkpoints import qwen3_thinking_checkpoint

    return qwen3_thinking_checkpoint(tmp_path_factory.mktemp("qwen3-thinking"))


@pytest.fixture(scope="module")
def server(thinking_checkpoint, tmp_path_factory):
    serve = ServeProcess(
        [
            "--model",
            str(thinking_checkpoint),
            *SERVE_ARGS,
            "--http-port",
            "0",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        ],
        tmp_path_factory.mktemp("responses"),
    )
    running = http_serve(serve)
    yield running
    with Client(running.address, timeout=60) as watcher:
        assert watcher.stats()["held_blocks"] == 0
    stop_and_check(running)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_text_response_streamed_and_not_is_the_chat_answer(client, model) -> None:
    greedy = {"max_output_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.responses.create(model=model, instructions="Be brief.", input="hello", **greedy)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == model
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.output_text == chat.choices[0].message.content
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 6

    events = list(client.responses.create(model=model, instructions="Be brief.", input="hello", stream=True, **greedy))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage.output_tokens == 6


def test_reasoning_on_chat_streamed_and_not(client, model) -> None:
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=40, extra_body=forced(THOUGHT))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user greets me.", "Hello there")
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=40, stream=True, extra_body=forced(THOUGHT)
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user greets me."
    assert "".join(d.content or "" for d in deltas) == "Hello there"
    # A reasoning delta never also carries content: the think block streams before the answer.
    assert all(not (getattr(d, "reasoning_content", None) and d.content) for d in deltas)
    # Log-probabilities and token ids still come, in chunks of their own, one entry a token.
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=40,
            stream=True,
            logprobs=True,
            extra_body={**forced(THOUGHT), "return_token_ids": True},
        )
    )
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert ids[0] == 4096 and 4097 in ids and len(entries) == len(ids) == whole.usage.completion_tokens
    # The usage counts the think block's tokens (between the tags), whole and in a stream's usage chunk.
    thought = ids.index(4097) - 1
    assert thought > 3 and whole.usage.completion_tokens_details.reasoning_tokens == thought
    last = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=40, stream=True, stream_options={"include_usage": True},
            extra_body=forced(THOUGHT),
        )
    )[-1]  # fmt: skip
    assert last.usage.completion_tokens_details.reasoning_tokens == thought
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=3, extra_body=forced("Hi"))
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    # An empty think block: reasoning_content "" (not null), whole and streamed alike.
    empty = {"model": model, "messages": messages, "max_tokens": 5, "extra_body": forced("<think></think>Hi")}
    message = client.chat.completions.create(**empty).choices[0].message
    assert (message.reasoning_content, message.content) == ("", "Hi")
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**empty, stream=True) if c.choices]
    assert [d.model_extra["reasoning_content"] for d in deltas if "reasoning_content" in d.model_extra] == [""]


def test_reasoning_items_on_responses_streamed_and_not(client, model) -> None:
    whole = client.responses.create(model=model, input="hello", max_output_tokens=40, extra_body=forced(THOUGHT))
    assert whole.status == "completed" and [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "The user greets me." and whole.output_text == "Hello there"
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=40, extra_body=forced(THOUGHT)
    )
    reasoning_tokens = whole.usage.output_tokens_details.reasoning_tokens
    assert reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens > 0
    events = list(
        client.responses.create(
            model=model, input="hello", max_output_tokens=40, stream=True, extra_body=forced(THOUGHT)
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "The user greets me."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")] and events[-1].type == "response.completed"
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    # The SDK's own stream helper accumulates the events into the same response.
    with client.responses.stream(
        model=model, input="hello", max_output_tokens=40, extra_body=forced(THOUGHT)
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == "Hello there" and final.output[0].content[0].text == "The user greets me."


def test_enable_thinking_reaches_the_template(server, model) -> None:
    def ids(kwargs: dict) -> list[int]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
        request = urllib.request.Request(
            server.url + "/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["tokens"]

    think, end = 4096, 4097  # the added <think>, </think>
    assert think not in ids({}) and end not in ids({"enable_thinking": True})
    empty_block = ids({"enable_thinking": False})[-6:]  # the header, then <think>\n\n</think>\n\n
    assert think in empty_block and end in empty_block


def test_function_tool_round_trip_streamed_and_not(client, model) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    named = {
        "type": "function",
        "name": "get_weather",
    }  # one call (random weights make "required" list calls on and on)
    first = client.responses.create(
        model=model, input=[question], tools=[WEATHER], tool_choice=named, max_output_tokens=40
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict) and call.call_id
    events = list(
        client.responses.create(
            model=model, input=[question], tools=[WEATHER], tool_choice=named, max_output_tokens=40, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(
        next(e for e in events if e.type == "response.output_item.done").item.arguments
    )
    # The answer to the call's result: the earlier output passed back as it came, then its result.
    answer = client.responses.create(
        model=model, tools=[WEATHER], max_output_tokens=4, extra_body={"ignore_eos": True},
        input=[question, *first.output, {"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny, 24 C"}],
    )  # fmt: skip
    assert [item.type for item in answer.output] == ["message"] and answer.usage.output_tokens == 4
    assert answer.usage.input_tokens > first.usage.input_tokens


def test_tool_calls_are_read_after_the_reasoning(client, model) -> None:
    whole = client.responses.create(
        model=model, input="weather?", tools=[WEATHER], max_output_tokens=60, extra_body=forced(CALL_AFTER_THOUGHT)
    )
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == "I should look it up." and json.loads(whole.output[1].arguments) == {
        "city": "Paris"
    }
    inside = (
        '<think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call>\n</think>\n\nNo call'
    )
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "weather?"}], tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}], max_tokens=60,
            extra_body=forced(inside))  # fmt: skip
    message = chat.choices[0].message
    assert message.tool_calls is None and message.content == "No call" and "<tool_call>" in message.reasoning_content
    # Streamed chat: the reasoning deltas, then the call read from what follows the block.
    chat_tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "weather?"}], tools=[chat_tool], max_tokens=60,
            stream=True, extra_body=forced(CALL_AFTER_THOUGHT),
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    [call_delta] = [d for d in deltas if d.tool_calls]
    assert reasoning == "I should look it up." and call_delta.tool_calls[0].function.name == "get_weather"
    assert json.loads(call_delta.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert deltas.index(call_delta) > max(i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_completions_and_embeddings_equal_transformers(client, model, server, thinking_checkpoint) -> None:
    """The other SDK endpoints on the same Qwen3: a greedy completion is transformers' greedy
    continuation, and an embedding transformers' last hidden state (normalized)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(thinking_checkpoint, dtype=torch.float32).eval()
    prompt = "Once upon a time"
    request = urllib.request.Request(
        server.url + "/tokenize",
        json.dumps({"model": model, "prompt": prompt}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        ids = json.loads(reply.read())["tokens"]
    completion = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with torch.inference_mode():
        tokens = torch.tensor([ids])
        out = hf.generate(
            tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
        hidden = hf.model(tokens).last_hidden_state[0, -1]
    assert completion.choices[0].model_extra["token_ids"] == out[0, len(ids) :].tolist()
    embedding = client.embeddings.create(model=model, input=prompt).data[0].embedding
    assert torch.allclose(torch.tensor(embedding), torch.nn.functional.normalize(hidden, dim=0), atol=1e-4)


class City(BaseModel):
    name: Literal["Paris", "Rome"]
    capital: bool


def test_structured_output_and_the_sdks_parse_helpers(client, model) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"enum": ["Paris", "Rome"]},
            "population": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "population"],
        "additionalProperties": False,
    }
    whole = client.responses.create(
        model=model,
        input="A city?",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    assert set(json.loads(whole.output_text)) == {"name", "population"}
    parsed = client.responses.parse(model=model, input="A city?", max_output_tokens=60, text_format=City)
    assert isinstance(parsed.output_parsed, City)
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A city?"}], max_tokens=60, response_format=City
    )
    assert isinstance(completion.choices[0].message.parsed, City)


def test_refusals_are_openai_errors(client, model) -> None:
    cases = [
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": "hi", "temperature": -1}, "temperature"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=model, max_output_tokens=2, **body)
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
    reply = client.responses.with_raw_response.create(
        model=model, input="hi", max_output_tokens=1, store=False, metadata={"k": "v"}, extra_body={"not_a_field": 1}
    )
    assert reply.headers["x-conveyor-ignored-fields"] == "metadata,not_a_field"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(reply.parse().id)
    assert "keeps no responses" in info.value.body["message"]


def test_reasoning_budget_closes_the_think_block(client, model) -> None:
    """``max_reasoning_tokens`` 3: the model opens the block, thinks at most 3 tokens, and
    ``</think>`` is then the only token allowed; the answer after it is free, or follows the
    answer's own constraint."""
    think, end = 4096, 4097
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=10,
        extra_body={"max_reasoning_tokens": 3, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    ids = whole.choices[0].model_extra["token_ids"]
    assert ids[0] == think and end in ids[1:5] and len(ids) == 10
    assert whole.usage.completion_tokens_details.reasoning_tokens == ids.index(end) - 1 <= 3
    assert whole.choices[0].message.reasoning_content is not None
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    shaped = client.responses.create(
        model=model,
        input="hello",
        max_output_tokens=20,
        extra_body={"max_reasoning_tokens": 2},
        text={"format": {"type": "json_schema", "name": "ok", "schema": schema, "strict": True}},
    )
    assert [item.type for item in shaped.output] == ["reasoning", "message"] and set(
        json.loads(shaped.output_text)
    ) == {"ok"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], extra_body={"max_reasoning_tokens": -1}
        )
    assert info.value.body["param"] == "max_reasoning_tokens"


TIME_TOOL = {
    "name": "get_time",
    "description": "the time in a zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
# Anthropic's documented raw event kinds (the SDK's stream also yields its own text/thinking/... events).
RAW = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


@pytest.fixture(scope="module")
def messages_api(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_anthropic_thinking_blocks_streamed_and_not(messages_api, client, model) -> None:
    """``thinking`` enabled with a budget: the model must open the think block (the budget's
    grammar), so the answer is a thinking block, then text: the chat answer's reasoning_content
    and content under ``max_reasoning_tokens`` (one request path). Streamed, the SDK sees
    Anthropic's sequence (thinking_delta, signature_delta, stop, then the text block) and
    accumulates the same message."""
    hello = [{"role": "user", "content": "hello"}]
    asked = {"model": model, "max_tokens": 10, "messages": hello, "thinking": {"type": "enabled", "budget_tokens": 3}}
    greedy = {"temperature": 0, "ignore_eos": True}
    msg = messages_api.messages.create(**asked, extra_body=greedy)
    chat = client.chat.completions.create(
        model=model, messages=hello, max_tokens=10, extra_body={**greedy, "max_reasoning_tokens": 3}
    ).choices[0]
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.stop_reason == "max_tokens"
    assert (msg.content[0].thinking, msg.content[1].text) == (chat.message.reasoning_content, chat.message.content)
    with messages_api.messages.stream(**asked, extra_body=greedy) as stream:
        raw = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream if e.type in RAW]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content
    ]
    assert final.usage.output_tokens == msg.usage.output_tokens == 10
    kinds = [kind for kind, _ in raw]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    signed = raw.index(("content_block_delta", "signature_delta"))
    assert {d for _, d in raw[1:signed] if d} <= {"thinking_delta"}
    assert kinds[signed + 1 : signed + 3] == ["content_block_stop", "content_block_start"]
    assert {d for _, d in raw[signed + 3 : -3]} == {"text_delta"} and kinds[-3] == "content_block_stop"
    # thinking disabled: the template renders an empty think block into the prompt; the answer is text.
    off = messages_api.messages.create(
        model=model, max_tokens=3, messages=hello, thinking={"type": "disabled"}, extra_body=greedy
    )
    assert [b.type for b in off.content] == ["text"]
    counted = {
        kind: messages_api.messages.count_tokens(model=model, messages=hello, thinking={"type": kind}).input_tokens
        for kind in ("enabled", "disabled")
    }
    assert counted["disabled"] > counted["enabled"] and counted["disabled"] == off.usage.input_tokens


def test_anthropic_tools_with_and_without_thinking(messages_api, model) -> None:
    """A tool forced (``tool_choice: tool``): a ``tool_use`` block, created and streamed (the
    SDK's ``input_json`` events); with thinking and ``auto`` the tools reach the template and the
    answer still opens with its thinking block."""
    ask = [{"role": "user", "content": "what time is it?"}]
    forced_tool = {"tools": [TIME_TOOL], "tool_choice": {"type": "tool", "name": "get_time"}}
    msg = messages_api.messages.create(model=model, max_tokens=40, messages=ask, extra_body={"seed": 3}, **forced_tool)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].name == "get_time" and msg.content[0].input["zone"] in ("utc", "cet")
    with messages_api.messages.stream(
        model=model, max_tokens=40, messages=ask, extra_body={"seed": 3}, **forced_tool
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use" and final.content[0].input == msg.content[0].input
    thought = messages_api.messages.create(
        model=model, max_tokens=8, messages=ask, tools=[TIME_TOOL], tool_choice={"type": "auto"},
        thinking={"type": "enabled", "budget_tokens": 2}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert thought.content[0].type == "thinking"
    count = messages_api.messages.count_tokens
    assert thought.usage.input_tokens == count(model=model, messages=ask, tools=[TIME_TOOL]).input_tokens
    assert thought.usage.input_tokens > count(model=model, messages=ask).input_tokens  # the tools are rendered
    # The call's result answered; an earlier turn's thinking block is dropped (as the templates drop reasoning).
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "utc"}}
    thinking = {"type": "thinking", "thinking": "hm", "signature": ""}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}
    turns = [*ask, {"role": "assistant", "content": [thinking, call]}, {"role": "user", "content": [result]}]
    answer = messages_api.messages.create(
        model=model, max_tokens=3, tools=[TIME_TOOL], messages=turns, extra_body={"temperature": 0}
    )
    unthought = [turns[0], {"role": "assistant", "content": [call]}, turns[2]]
    assert answer.usage.input_tokens == count(model=model, messages=unthought, tools=[TIME_TOOL]).input_tokens
    assert answer.usage.input_tokens > thought.usage.input_tokens
