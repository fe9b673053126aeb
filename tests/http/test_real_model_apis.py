"""The real default model (SmolLM2-135M-Instruct, its GGUF file) behind one bin/serve --http-port,
asked through each official SDK unchanged: OpenAI's ``responses.create`` and
``chat.completions.create`` and Anthropic's ``messages.create`` answer a capital question with
the capital (greedy; tests/bench/test_eval.py holds the same answer equal to transformers'), and
OpenAI's ``embeddings.create`` gives transformers' pooled hidden state of the same file."""

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


def test_anthropic_messages_answer_a_capital_question(server, openai_client) -> None:
    model = openai_client.models.list().data[0].id
    api = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    reply = api.messages.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, extra_body={"temperature": 0}
    )
    assert reply.content[0].type == "text" and "Paris" in reply.content[0].text


def test_embeddings_equal_transformers_pooled_hidden_state(server, openai_client) -> None:
    from transformers import AutoModel

    from conveyor.checkpoints.gguf.default_model import default_model_file

    model = openai_client.models.list().data[0].id
    texts = ["The capital of France is Paris.", "A cat sat on the mat."]
    got = openai_client.embeddings.create(model=model, input=texts)
    source = default_model_file()
    hf = AutoModel.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32).eval()
    for text, item in zip(texts, got.data):
        body = json.dumps({"model": model, "prompt": text}).encode()
        request = urllib.request.Request(server.url + "/tokenize", body, {"Content-Type": "application/json"})
        ids = json.loads(urllib.request.urlopen(request, timeout=60).read())["tokens"]
        with torch.inference_mode():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(torch.tensor(item.embedding), expected, atol=1e-4), text
