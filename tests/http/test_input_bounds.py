"""Issue 43's size findings, at CI scale, against bin/serve --http-port: every size bound is
checked before the work it bounds, and no client input is a 500.

- a prompt far past the model length with ``return_token_ids`` / ``continuous_usage_stats``,
  and ``/tokenize``, are refused (400 ``prompt``) by the frontend before it tokenizes them (the
  HTTP process tokenizes nothing: tests/http/test_no_tokenizer.py)
  (before: tokenized whole, seconds and hundreds of MB per request);
- a large ``tools`` list behind one short message is refused before the chat template renders
  it (before: rendered on the frontend's loop, stalling every other client);
- ``stop_token_ids`` has a count bound;
- objects over 256 keys (a ``logit_bias`` of 257 entries, a schema of 300 properties) are served,
  and a body nested 990 or 5,000 deep or holding an object over the map bound is a 400 naming
  its field (before: 500s).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from conveyor.protocol.limits import MAX_JSON_DEPTH, MAX_MAP_LEN, MAX_STOP_TOKEN_IDS
from tests.http.test_raw_http import assert_error, model_of, request

BIG = 2_000_000  # characters: far past any model length here, ~1 s+ of tokenizing each before


async def _post(session: aiohttp.ClientSession, url: str, body: dict | bytes) -> tuple[int, dict, float]:
    start = time.monotonic()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data) as response:
        return response.status, await response.json(content_type=None), time.monotonic() - start


def _neighbour_meanwhile(server, attacks: list[tuple[str, dict]]) -> tuple[list[tuple[int, dict, float]], float, float]:
    """The attack requests, sent together, and a short completion sent beside them: their
    answers, the neighbour's latency while they ran, and its latency alone afterwards."""
    model = model_of(server)
    short = {"model": model, "prompt": "hello there", "max_tokens": 4}

    async def go():
        async with aiohttp.ClientSession() as session:
            await _post(session, server.url + "/v1/completions", short)  # warm
            tasks = [asyncio.ensure_future(_post(session, server.url + path, body)) for path, body in attacks]
            await asyncio.sleep(0.05)
            status, _, during = await _post(session, server.url + "/v1/completions", short)
            assert status == 200
            answers = await asyncio.gather(*tasks)
            alone = min([(await _post(session, server.url + "/v1/completions", short))[2] for _ in range(3)])
            return answers, during, alone

    return asyncio.run(go())


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_long_prompts_are_refused_before_the_http_process_tokenizes_them(http_server) -> None:
    model = model_of(http_server)
    text = "lorem ipsum " * (BIG // 12)
    rss_before = _rss_mb(http_server.pids["http"])
    attacks = [
        ("/v1/completions", {"model": model, "prompt": text, "max_tokens": 1, "return_token_ids": True}),
        (
            "/v1/completions",
            {
                "model": model,
                "prompt": text,
                "max_tokens": 1,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        ),
        ("/tokenize", {"model": model, "prompt": text}),
        ("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}),
        ("/tokenize", {"model": model, "messages": [{"role": "user", "content": text}]}),
    ]
    answers, during, alone = _neighbour_meanwhile(http_server, attacks)
    for status, body, took in answers:
        assert_error((status, body), 400, param="prompt" if "prompt" in body["error"]["message"][:8] else "messages")
        assert "cannot fit the model length" in body["error"]["message"]
        assert took < 5.0, took  # measured: well under a second; before: seconds each
    assert during < alone + 1.0, (during, alone)
    assert _rss_mb(http_server.pids["http"]) - rss_before < 150


def test_a_large_tools_list_is_refused_before_it_is_rendered(http_server) -> None:
    model = model_of(http_server)
    tool = {"type": "function", "function": {"name": "f", "description": "x" * 1000, "parameters": {"type": "object"}}}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool] * (BIG // 1000),
        "max_tokens": 1,
    }
    answers, during, alone = _neighbour_meanwhile(http_server, [("/v1/chat/completions", body)] * 3)
    for status, reply, took in answers:
        assert_error((status, reply), 400, param="messages", code=None)
        assert "with tools" in reply["error"]["message"]
        assert took < 5.0, took
    assert during < alone + 1.0, (during, alone)


def test_stop_token_ids_have_a_count_bound(http_server) -> None:
    model = model_of(http_server)
    base = {"model": model, "prompt": "hi", "max_tokens": 2}
    assert (
        request(http_server, "POST", "/v1/completions", {**base, "stop_token_ids": [5] * MAX_STOP_TOKEN_IDS})[0] == 200
    )
    reply = request(http_server, "POST", "/v1/completions", {**base, "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)})
    assert_error(reply, 400, param="stop_token_ids")


def test_objects_over_256_keys_are_served(http_server) -> None:
    model = model_of(http_server)
    base = {"model": model, "prompt": "hi", "max_tokens": 2}
    status, body = request(
        http_server, "POST", "/v1/completions", {**base, "logit_bias": {str(i): 0.5 for i in range(257)}}
    )
    assert status == 200, body
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    status, body = request(http_server, "POST", "/v1/completions", {**base, "guided_json": schema})
    assert status == 200, body
    status, body = request(http_server, "POST", "/v1/completions", {**base, "user": {str(i): 1 for i in range(300)}})
    assert status == 200, body


def test_deep_or_wide_json_is_a_400_naming_the_field(http_server) -> None:
    model = model_of(http_server)
    head = f'{{"model": "{model}", "prompt": "hi", "max_tokens": 2, '
    for depth in (MAX_JSON_DEPTH + 1, 990, 5000):
        for field in ("guided_json", "user"):
            raw = (head + f'"{field}": ' + "[" * depth + "]" * depth + "}").encode()
            reply = request(http_server, "POST", "/v1/completions", raw=raw)
            assert_error(reply, 400)
            if depth < 990:  # deeper than the decoder's stack: the body as a whole is named
                assert reply[1]["error"]["param"] == field, reply
    ok = (head + '"user": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}").encode()
    assert request(http_server, "POST", "/v1/completions", raw=ok)[0] == 200
    wide = {"model": model, "prompt": "hi", "max_tokens": 2, "user": {str(i): 0 for i in range(MAX_MAP_LEN + 1)}}
    assert_error(request(http_server, "POST", "/v1/completions", wide), 400, param="user")
    # the server is still whole
    assert request(http_server, "GET", "/health")[0] == 200


def test_the_zeromq_path_counts_tools_before_rendering(http_server) -> None:
    """The same refusal from the frontend, for a ZeroMQ client (no HTTP in between)."""
    from conveyor.client import Client

    tool = {"type": "function", "function": {"name": "f", "description": "x" * 1000, "parameters": {"type": "object"}}}
    with Client(http_server.address) as client:
        start = time.monotonic()
        result = client.generate(messages=[{"role": "user", "content": "hi"}], tools=[tool] * 2000, max_tokens=1)
        assert result.finish_reason == "error" and "with tools" in result.error, result
        assert time.monotonic() - start < 5.0
        result = client.generate(prompt="hi", stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1), max_tokens=1)
        assert result.finish_reason == "error" and "stop_token_ids" in result.error, result
