"""``POST /v1/embeddings`` against bin/serve: the openai SDK's ``embeddings.create`` (base64,
its default, and float), vectors equal to HF transformers' pooled final hidden states (last
and mean, a prompt prefilled in several chunks among them), ``Client.embed`` over ZeroMQ,
embeddings batched with streaming generations (both right), the refusals, and no KV held after."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
import torch

from conveyor.client import Client
from tests.e2e.serve_harness import ServeProcess
from tests.http.conftest import SERVE_ARGS, http_serve, stop_and_check

# A 16-token budget: the 100-token input runs in 7 chunks.
ARGS = [a if a != "256" else "16" for a in SERVE_ARGS]
LONG = [(13 * i) % 250 + 3 for i in range(100)]
INPUTS = [[5], [7, 8, 9, 10, 11], [(5 * i) % 200 + 4 for i in range(33)], LONG]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    serve = ServeProcess(["--model", str(tiny_checkpoint), *ARGS, "--http-port", "0"], tmp_path_factory.mktemp("embed"))
    running = http_serve(serve)
    yield running
    with Client(running.address, timeout=60) as watcher:
        assert watcher.stats()["held_blocks"] == 0  # every pooling request gave its KV back
    stop_and_check(running)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model(server) -> str:
    return _client(server).models.list().data[0].id


def _post(server, path: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _close(ours, ref: torch.Tensor) -> None:
    ours = torch.tensor(ours, dtype=torch.float32)
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) > 0.9999


def test_sdk_embeddings_equal_transformers(server, hf_pooled) -> None:
    """The SDK's default request (base64) and a float one with mean pooling (Conveyor's field)."""
    client, model = _client(server), _model(server)
    last = client.embeddings.create(model=model, input=INPUTS)
    assert [d.index for d in last.data] == [0, 1, 2, 3] and last.model == model
    assert last.usage.prompt_tokens == last.usage.total_tokens == sum(map(len, INPUTS))
    for tokens, item in zip(INPUTS, last.data):
        _close(item.embedding, hf_pooled(tokens, "last"))
    mean = client.embeddings.create(model=model, input=INPUTS, encoding_format="float", extra_body={"pooling": "mean"})
    for tokens, item in zip(INPUTS, mean.data):
        _close(item.embedding, hf_pooled(tokens, "mean"))
    single = client.embeddings.create(model=model, input=LONG, encoding_format="float")
    assert len(single.data) == 1
    _close(single.data[0].embedding, hf_pooled(LONG, "last"))


def test_text_inputs_pool_their_tokenized_prompt(server, hf_pooled) -> None:
    """Text is tokenized as a completion's prompt (what /tokenize gives)."""
    texts = ["hello world", "The quick brown fox jumps over the lazy dog"]
    out = _client(server).embeddings.create(model=_model(server), input=texts)
    for text, item in zip(texts, out.data):
        status, _, tokenized = _post(server, "/tokenize", {"prompt": text})
        assert status == 200
        _close(item.embedding, hf_pooled(tokenized["tokens"], "last"))
    assert out.usage.prompt_tokens == sum(len(_post(server, "/tokenize", {"prompt": t})[2]["tokens"]) for t in texts)


def test_zmq_client_embed(server, hf_pooled) -> None:
    with Client(server.address, timeout=60) as client:
        for pooling in ("last", "mean"):
            result = client.embed(token_ids=LONG, pooling=pooling)
            assert result.finish_reason == "stop" and result.token_ids == [] and result.usage.prompt_tokens == len(LONG)
            _close(result.embedding, hf_pooled(LONG, pooling))
        refused = client.embed(token_ids=[1, 2], pooling="max")
        assert refused.finish_reason == "error" and "'pooling' must be one of" in refused.error


def test_embeddings_while_generations_stream(server, hf_pooled, hf_greedy) -> None:
    """Generations stream while embedding requests run: the steps mix both (the iteration log
    shows steps with decodes and prompt tokens), the streamed tokens are transformers' greedy
    ones and the vectors transformers' pooled ones."""
    prompts = [[20 + i, 30, 40, 50 + i] for i in range(2)]
    streamed: dict[int, list[int]] = {}

    def generate(i: int) -> None:
        with Client(server.address, timeout=60) as client:
            tokens = streamed.setdefault(i, [])
            for delta in client.stream(token_ids=prompts[i], max_tokens=60, temperature=0, ignore_eos=True):
                tokens += delta.token_ids

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    try:
        with Client(server.address, timeout=60) as client:
            while sum(len(t) for t in streamed.values()) < 4:  # both are decoding
                threading.Event().wait(0.01)
            out = _client(server).embeddings.create(model=_model(server), input=INPUTS * 2, encoding_format="float")
            rows = client.stats(iterations=True)
    finally:
        for thread in threads:
            thread.join(60)
    for tokens, item in zip(INPUTS * 2, out.data):
        _close(item.embedding, hf_pooled(tokens, "last"))
    for i, prompt in enumerate(prompts):
        assert streamed[i] == hf_greedy(prompt, 60)
    mixed = [row for row in rows["iterations"] if row["decode_tokens"] and row["prefill_tokens"]]
    assert mixed, "no step ran embeddings' prompts beside the generations' decodes"


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"input": [1, 2], "dimensions": 8}, "dimensions", "'dimensions'"),
        ({"input": [1, 2], "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": [1, 2], "pooling": "cls"}, "pooling", "'last', 'mean'"),
        ({"input": []}, "input", "an empty array"),
        ({"input": [[1], "a"]}, "input", "'input' must be"),
        ({}, "input", "'input' is required"),
    ],
)
def test_refusals_name_the_field(server, body, param, text) -> None:
    status, _, reply = _post(server, "/v1/embeddings", {"model": _model(server), **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param and text in reply["error"]["message"], reply


def test_unknown_model_and_ignored_fields(server) -> None:
    status, _, reply = _post(server, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    status, headers, reply = _post(
        server, "/v1/embeddings", {"model": _model(server), "input": [3, 4], "user": "u", "extra_knob": 1}
    )
    assert status == 200 and headers.get("x-conveyor-ignored-fields") == "extra_knob,user"
    assert len(reply["data"][0]["embedding"]) == 64
