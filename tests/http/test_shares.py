"""Issue 43, findings 5 and 7, at CI scale: bin/serve --http-port with ``--client-send-queue 32
--max-waiting 64``.

- The HTTP process's one connection to the frontend is not an untrusted client that stopped
  reading: a burst of 40 streams through it all finish (before: a lowered
  ``--client-send-queue`` dropped that connection on the first burst, and 200 streams were
  aborted and hung);
- one HTTP request may ask for at most a quarter of ``--max-waiting`` sequences (prompts x n):
  past that a 400 naming ``n`` or ``prompt`` (before: 1,024 prompts x n = 64 filled the queue
  and every other client got 429), and the server serves others meanwhile.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.http.test_raw_http import assert_error, model_of, request

STREAMS = 40


@pytest.fixture(scope="module")
def shared(tiny_checkpoint, tmp_path_factory):
    from tests.e2e.serve_harness import ServeProcess
    from tests.http.conftest import SERVE_ARGS, http_serve, stop_and_check

    args = [
        "--model",
        str(tiny_checkpoint),
        *SERVE_ARGS,
        "--http-port",
        "0",
        "--client-send-queue",
        "32",
        "--max-waiting",
        "64",
    ]
    server = http_serve(ServeProcess(args, tmp_path_factory.mktemp("shares")))
    yield server
    stop_and_check(server)


def test_a_burst_of_streams_through_the_http_process_is_not_dropped(shared) -> None:
    model = model_of(shared)

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str]:
        body = {"model": model, "prompt": f"stream {i}", "max_tokens": 40, "ignore_eos": True, "stream": True}
        async with session.post(shared.url + "/v1/completions", data=json.dumps(body)) as response:
            return response.status, await response.text()

    async def burst():
        async with aiohttp.ClientSession() as session:
            return await asyncio.wait_for(asyncio.gather(*(one(session, i) for i in range(STREAMS))), 120)

    for status, text in asyncio.run(burst()):
        assert status == 200, text
        assert (
            text.rstrip().endswith("data: [DONE]") and '"error":{' not in text and '"finish_reason":"length"' in text
        ), text[-500:]
    assert "not reading its replies" not in shared.serve.output()


def test_one_request_may_take_a_quarter_of_the_queue(shared) -> None:
    model = model_of(shared)
    base = {"model": model, "max_tokens": 2}
    assert request(shared, "POST", "/v1/completions", {**base, "prompt": ["a"] * 16})[0] == 200
    assert request(shared, "POST", "/v1/completions", {**base, "prompt": ["a"] * 2, "n": 8})[0] == 200
    assert_error(request(shared, "POST", "/v1/completions", {**base, "prompt": ["a"] * 17}), 400, param="prompt")
    reply = request(shared, "POST", "/v1/completions", {**base, "prompt": ["a"] * 4, "n": 8})
    assert_error(reply, 400, param="n")
    assert "a quarter of the server's --max-waiting 64" in reply[1]["error"]["message"]
    reply = request(
        shared, "POST", "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}], "n": 17}
    )
    assert_error(reply, 400, param="n")
    assert request(shared, "POST", "/v1/completions", {**base, "prompt": "still served"})[0] == 200
