"""Raw HTTP against bin/serve --http-port (aiohttp's client): malformed and mistyped bodies,
an oversized body, unknown model and paths, and clients that go away mid-request, whose
requests must be aborted at the server: counted as aborts, their KV blocks free within
ABORT_BOUND_S (tests/e2e/serve_harness.py) of the disconnect, long before they would end."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from conveyor.client import Client
from conveyor.http.app import MAX_BODY_BYTES
from conveyor.protocol.limits import MAX_CLIENT_MESSAGE_BYTES
from tests.e2e.serve_harness import (
    LONG_MAX_TOKENS,
    LONG_SERVE_ARGS,
    ServeProcess,
    assert_aborted_and_freed,
    finished_counts,
    long_context_copy,
)
from tests.http.conftest import http_serve, stop_and_check


def request(server, method: str, path: str, body=None, *, raw: bytes | None = None) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as session:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            async with session.request(method, server.url + path, data=data) as response:
                return response.status, await response.json(content_type=None)

    return asyncio.run(go())


def model_of(server) -> str:
    return request(server, "GET", "/v1/models")[1]["data"][0]["id"]


def assert_error(reply: tuple[int, dict], status: int, param: str | None = None, code: str | None = None) -> None:
    got, body = reply
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_models_and_health(http_server, tiny_checkpoint) -> None:
    status, body = request(http_server, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list" and body["data"][0]["id"] == tiny_checkpoint.name
    assert request(http_server, "GET", "/health") == (200, {"status": "ok"})


def test_malformed_json_and_wrong_types_are_400_naming_the_field(http_server) -> None:
    model = model_of(http_server)
    assert_error(
        request(http_server, "POST", "/v1/completions", raw=b'{"model": "x", "prompt": '), 400, code="invalid_json"
    )
    assert_error(request(http_server, "POST", "/v1/completions", raw=b"\xff\xfe"), 400, code="invalid_json")
    assert_error(request(http_server, "POST", "/v1/completions", ["not", "an", "object"]), 400)
    cases = [
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "hi", "ignore_eos": "true"}, "ignore_eos"),
        ("/v1/completions", {"prompt": "hi", "priority": 1.5}, "priority"),
        ("/v1/completions", {"prompt": [999999]}, "prompt"),  # outside the vocabulary: the frontend says so
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
        (
            "/v1/completions",
            {"prompt": "hi", "tools": []},
            "tools",
        ),  # a chat field (an unknown one is ignored: test_compat_fields)
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_k": -1, "stream": True},
            "top_k",
        ),
    ]
    for path, body, param in cases:
        assert_error(request(http_server, "POST", path, {"model": model, **body}), 400, param)


def test_unsupported_unknown_and_oversized(http_server) -> None:
    model = model_of(http_server)
    assert_error(
        request(http_server, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
        404,
        "model",
        "model_not_found",
    )
    assert_error(request(http_server, "POST", "/v1/completions", {"model": model, "prompt": "hi", "n": 65}), 400, "n")
    # n > 1 with log-probabilities: not per sequence yet, refused naming the field
    # n > 1 with logprobs is served (no longer refused): each choice's own logprobs object
    served = {"model": model, "prompt": "hi", "n": 2, "logprobs": 1, "max_tokens": 3, "ignore_eos": True}
    status, body = request(http_server, "POST", "/v1/completions", served)
    assert status == 200 and [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [3, 3], body
    # past --max-logprobs (20): the frontend's refusal names the field
    assert_error(
        request(http_server, "POST", "/v1/completions", {"model": model, "prompt": "hi", "logprobs": 21}),
        400,
        "logprobs",
    )
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}
    assert_error(request(http_server, "POST", "/v1/chat/completions", chat), 400, "logprobs")
    assert_error(request(http_server, "GET", "/v1/nothing-here"), 404, code="not_found")
    assert_error(request(http_server, "GET", "/v1/completions"), 405)
    big = {"model": model, "prompt": "a" * MAX_CLIENT_MESSAGE_BYTES}
    assert_error(request(http_server, "POST", "/v1/completions", big), 413, code="request_too_large")
    # just under the limit: the body is taken, and the frontend judges the prompt (too long for the model)
    fits = json.dumps({"model": model, "prompt": "a"}).encode()
    near = fits.replace(b'"a"', b'"' + b"a " * ((MAX_BODY_BYTES - len(fits)) // 2) + b'"')
    assert_error(request(http_server, "POST", "/v1/completions", raw=near), 400, "prompt")


@pytest.fixture(scope="module")
def http_server(tiny_checkpoint, tmp_path_factory):  # noqa: F811 - this module's own: requests that can run long
    """The package's HTTP server, on a copy of the tiny checkpoint that allows LONG_MODEL_LEN
    tokens, so that a dropped request would run on for many seconds if it were not aborted."""
    tmp = tmp_path_factory.mktemp("http-long")
    checkpoint = long_context_copy(tiny_checkpoint, tmp)
    server = http_serve(ServeProcess(["--model", str(checkpoint), *LONG_SERVE_ARGS, "--http-port", "0"], tmp))
    yield server
    stop_and_check(server)


def running(watcher: Client) -> bool:
    return watcher.stats()["held_blocks"] > 0


@pytest.mark.parametrize("path, n", [("/v1/completions", 1), ("/v1/chat/completions", 1), ("/v1/completions", 3)])
def test_a_stream_dropped_mid_way_is_aborted(http_server, path, n) -> None:
    """An SSE stream of LONG_MAX_TOKENS closed after a few chunks: the server counts an abort
    and frees its blocks within ABORT_BOUND_S (it would otherwise stream for ~16 s); with
    ``n`` = 3, every sequence's blocks."""
    model = model_of(http_server)
    body = {"model": model, "max_tokens": LONG_MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True, "n": n}
    body.update(
        {"prompt": [10] * 40} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi " * 20}]}
    )

    async def drop_after_a_few_chunks(watcher: Client) -> tuple[dict[str, int], float]:
        async with aiohttp.ClientSession() as session:
            response = await session.post(http_server.url + path, json=body)
            assert response.status == 200
            for _ in range(5):
                line = await response.content.readline()
                assert line
            assert await asyncio.to_thread(running, watcher), "the request held no blocks while streaming"
            before = await asyncio.to_thread(finished_counts, watcher)
            response.close()  # the connection goes away mid-stream
            return before, time.monotonic()

    with Client(http_server.address) as watcher:
        before, dropped_at = asyncio.run(drop_after_a_few_chunks(watcher))
        assert_aborted_and_freed(watcher, before, dropped_at)


def test_an_unstreamed_request_given_up_is_aborted(http_server) -> None:
    """A whole (unstreamed) request of LONG_MAX_TOKENS whose client gives up while it runs:
    aborted and freed within ABORT_BOUND_S, as a stream is."""
    body = {
        "model": model_of(http_server),
        "prompt": [11] * 40,
        "max_tokens": LONG_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def give_up(watcher: Client) -> tuple[dict[str, int], float]:
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(session.post(http_server.url + "/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while not await asyncio.to_thread(running, watcher):
                assert time.monotonic() < deadline, "the request never started"
                await asyncio.sleep(0.02)
            before = await asyncio.to_thread(finished_counts, watcher)
            task.cancel()  # closes the connection
            dropped_at = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await task
            return before, dropped_at

    with Client(http_server.address) as watcher:
        before, dropped_at = asyncio.run(give_up(watcher))
        assert_aborted_and_freed(watcher, before, dropped_at)
