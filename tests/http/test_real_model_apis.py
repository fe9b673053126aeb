"""The real default model (SmolLM2-135M-Instruct, its GGUF file) behind one bin/serve --http-port,
asked through each official SDK unchanged: OpenAI's ``responses.create``,
``chat.completions.create`` and ``completions.create`` and Anthropic's ``messages.create``
answer a capital question with the capital (greedy; tests/bench/test_eval.py holds the same
answer equal to transformers'), ``responses.create`` with a function tool (streamed and not),
``chat.completions.parse`` with a pydantic model, ``messages.stream``, ``count_tokens``, a
forced Anthropic tool and ``thinking`` enabled answer as they should, and OpenAI's
``embeddings.create`` gives transformers' pooled hidden state of the same file."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import openai
import pytest
import torch

from tests.e2e.serve_harness import ServeProcess
from tests.http.conftest import http_serve, stop_and_check

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conveyor.checkpoints.gguf.default_model import FetchError, default_model_file

    try:
        default_model_file()
    except FetchError as exc:
        pytest.skip(f"the default model cannot be fetched here: {exc}")
    served = http_serve(
        ServeProcess(["--threads", "1", "--num-kv-blocks", "64", "--http-port", "0"], tmp_path_factory.mktemp("real"))
    )
    yield served
    stop_and_check(served)


@pytest.fixture(scope="module")
def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_responses_create_answers_a_capital_question(openai_client) -> None:
    model = openai_client.models.list().data[0].id
    reply = openai_client.responses.create(model=model, input=QUESTION, max_output_tokens=12, temperature=0)
    assert reply.status in ("completed", "incomplete") and reply.output[0].type == "message"
    assert "Paris" in reply.output_text, reply.output_text


def test_chat_completions_answer_a_capital_question(openai_client) -> None:
    model = openai_client.models.list().data[0].id
    messages = [{"role": "user", "content": QUESTION}]
    reply = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    completion = openai_client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert "Paris" in completion.choices[0].text, completion.choices[0].text


def test_anthropic_messages_answer_a_capital_question(server, openai_client) -> None:
    model = openai_client.models.list().data[0].id
    api = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    reply = api.messages.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, extra_body={"temperature": 0}
    )
    assert reply.content[0].type == "text" and "Paris" in reply.content[0].text


def test_embeddings_equal_transformers_pooled_hidden_state(server, openai_client, real_hf_model) -> None:
    model = openai_client.models.list().data[0].id
    texts = ["The capital of France is Paris.", "A cat sat on the mat."]
    got = openai_client.embeddings.create(model=model, input=texts)
    hf = real_hf_model.model  # the decoder under the LM head: its last_hidden_state is AutoModel's
    for text, item in zip(texts, got.data):
        body = json.dumps({"model": model, "prompt": text}).encode()
        request = urllib.request.Request(server.url + "/tokenize", body, {"Content-Type": "application/json"})
        ids = json.loads(urllib.request.urlopen(request, timeout=60).read())["tokens"]
        with torch.inference_mode():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(torch.tensor(item.embedding), expected, atol=1e-4), text


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_responses_function_tool_streamed_and_not(openai_client) -> None:
    """A forced function tool on the real model: one ``function_call`` item naming the city
    asked about, the same call streamed (its arguments in the function_call_arguments events)."""
    model = openai_client.models.list().data[0].id
    asked = {
        "model": model,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 40,
        "temperature": 0,
    }
    whole = openai_client.responses.create(**asked)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert "Paris" in json.loads(call.arguments)["city"], call.arguments
    events = list(openai_client.responses.create(**asked, stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(call.arguments) and events[-1].type == "response.completed"


def test_chat_completions_parse_with_a_pydantic_model(openai_client) -> None:
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        capital: str

    model = openai_client.models.list().data[0].id
    messages = [{"role": "user", "content": QUESTION + " Answer in JSON."}]
    completion = openai_client.chat.completions.parse(
        model=model, messages=messages, max_tokens=40, temperature=0, response_format=Capital
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital) and "Paris" in parsed.capital, parsed


def test_anthropic_stream_tool_and_thinking(server, openai_client) -> None:
    """``messages.stream`` gives ``messages.create``'s text; a forced tool a ``tool_use`` block;
    ``thinking`` enabled reaches the template as ``enable_thinking`` (SmolLM2's ignores it: the
    same answer), its ``budget_tokens`` named as ignored (no --reasoning-parser here)."""
    model = openai_client.models.list().data[0].id
    api = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    asked = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12}
    whole = api.messages.create(**asked, extra_body={"temperature": 0})
    with api.messages.stream(**asked, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens
    counted = api.messages.count_tokens(model=model, messages=asked["messages"]).input_tokens
    assert counted == whole.usage.input_tokens == final.usage.input_tokens
    thinking = api.messages.with_raw_response.create(
        **asked, thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0}
    )
    assert thinking.headers["x-conveyor-ignored-fields"] == "thinking.budget_tokens"
    assert [(b.type, b.text) for b in thinking.parse().content] == [("text", whole.content[0].text)]
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    call = api.messages.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=40,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    assert call.stop_reason == "tool_use" and call.content[0].type == "tool_use"
    assert "Paris" in call.content[0].input["city"], call.content[0].input
