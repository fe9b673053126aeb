"""bin/serve's HTTP process in the server's life: the metrics-only listener, /health going to
503 when a process dies (and the HTTP process going with the server), 429 at the queue bound,
and a port in use failing the start."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import prometheus_client

from tests.e2e.serve_harness import REPO
from tests.http.conftest import SERVE_ARGS


async def fetch(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> tuple[int, dict | str, str]:
    async with session.request(method, url, **kwargs) as response:
        text = await response.text()
        try:
            body = await response.json(content_type=None)
        except ValueError:
            body = text
        return response.status, body, response.headers.get("Content-Type", "")


def get(url: str) -> tuple[int, dict | str, str]:
    async def go():
        async with aiohttp.ClientSession() as session:
            return await fetch(session, "GET", url)

    return asyncio.run(go())


def test_metrics_port_alone_then_health_503_when_the_scheduler_dies(http_factory, tiny_checkpoint) -> None:
    server = http_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, "--metrics-port", "0")
    assert server.url is None
    base = server.metrics_url
    assert get(base + "/health")[0] == 200
    status, body, content_type = get(base + "/metrics")
    assert status == 200 and content_type == prometheus_client.CONTENT_TYPE_LATEST
    assert "conveyor:" in body
    assert get(base + "/v1/models")[0] == 404  # the API is on --http-port only
    os.kill(server.pids["scheduler"], signal.SIGKILL)
    status, body, _ = get(base + "/health")
    assert status == 503 and body["error"]["code"] == "unhealthy", body
    assert server.serve.proc.wait(15) != 0
    assert "scheduler process died" in server.serve.output()


def test_the_queue_bound_is_429(http_factory, tiny_checkpoint) -> None:
    server = http_factory(
        "--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0", "--max-waiting", "1", "--max-num-seqs", "1"
    )  # fmt: skip
    model = get(server.url + "/v1/models")[1]["data"][0]["id"]

    async def burst():
        async with aiohttp.ClientSession() as session:
            bodies = [
                {"model": model, "prompt": [10 + i] * 8, "max_tokens": 40, "ignore_eos": True, "stream": i % 2 == 1}
                for i in range(8)
            ]
            return await asyncio.gather(
                *(fetch(session, "POST", server.url + "/v1/completions", json=b) for b in bodies)
            )

    replies = asyncio.run(burst())
    statuses = sorted(status for status, _, _ in replies)
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}, statuses
    for status, body, _ in replies:
        if status == 429:
            assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "overloaded", body
            assert body["error"]["message"].startswith("overloaded:")


def test_a_port_in_use_fails_the_start(tiny_checkpoint, tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, str(REPO / "bin" / "serve"), "--host", f"ipc://{tmp_path}/s.sock", "--model",
             str(tiny_checkpoint),
             *SERVE_ARGS, "--http-port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode != 0
    assert f"--http-port {port}" in out.stderr and "in use" in out.stderr, out.stderr  # bin/serve's check before start
    assert "ready on" not in out.stdout
