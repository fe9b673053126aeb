"""Fixtures of the HTTP face's tests: bin/serve with ``--http-port 0`` (and/or ``--metrics-port
0``) on the tiny checkpoint of tests/e2e, its HTTP address read from what bin/serve prints.

``tiny_checkpoint`` and ``serve_factory`` are tests/e2e's fixtures, imported here so that
pytest registers them for this package too. ``http_server`` is one server shared by a test
module (starting one costs seconds); its teardown, like ``serve_factory``'s, proves that no
process outlives bin/serve, the HTTP process included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from conveyor.client import Client
from tests.e2e.conftest import hf_controlled, hf_greedy, hf_logprobs, hf_pooled, serve_factory, tiny_checkpoint  # noqa: F401  (fixtures, registered here)
from tests.e2e.serve_harness import ServeProcess, alive

SERVE_ARGS = ("--num-kv-blocks", "96", "--block-size", "8", "--threads", "1", "--max-num-batched-tokens", "256")


@dataclass
class HttpServe:
    """bin/serve with its HTTP face: ``url`` of the API (None with only --metrics-port),
    ``metrics_url`` of the metrics listener (None without --metrics-port), and the pids."""

    serve: ServeProcess
    url: str | None
    metrics_url: str | None
    pids: dict[str, int]

    @property
    def address(self) -> str:
        return self.serve.address


def _printed(serve: ServeProcess, marker: str, end: str) -> str | None:
    for line in list(serve.stderr):
        if marker in line:
            return line.split(marker, 1)[1].split(end, 1)[0].strip()
    return None


def http_serve(serve: ServeProcess) -> HttpServe:
    """What bin/serve printed about its HTTP process (stderr is pumped by a thread: wait a little)."""
    deadline = time.monotonic() + 10
    while True:
        pid = _printed(serve, "conveyor: http ready (pid ", ")")
        api = _printed(serve, "OpenAI-compatible API on ", "/v1")
        metrics = _printed(serve, "Prometheus metrics on ", "/metrics")
        if pid and (api or metrics):
            break
        assert time.monotonic() < deadline, f"no HTTP lines:\n{serve.output()}"
        time.sleep(0.02)
    return HttpServe(serve, api, metrics, {**serve.pids, "http": int(pid)})


def stop_and_check(server: HttpServe) -> None:
    """Stop bin/serve (if it still runs) and prove every child, the HTTP process included, is gone."""
    if server.serve.proc.poll() is None:
        server.serve.terminate()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in server.pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {name: pid for name, pid in server.pids.items() if alive(pid)}
    if left:
        server.serve.kill()
    assert not left, f"orphaned processes after shutdown: {left}"


@pytest.fixture(scope="module")
def http_server(tiny_checkpoint, tmp_path_factory):  # noqa: F811
    serve = ServeProcess(
        ["--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0"], tmp_path_factory.mktemp("http")
    )
    server = http_serve(serve)
    yield server
    stop_and_check(server)


@pytest.fixture(scope="module")
def tool_server(tiny_checkpoint, tmp_path_factory):  # noqa: F811
    """A module's own server that reads Hermes-format tool calls; it must end holding no KV."""
    serve = ServeProcess(
        ["--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0", "--tool-call-parser", "hermes"],
        tmp_path_factory.mktemp("tools"),
    )
    running = http_serve(serve)
    yield running
    with Client(running.address, timeout=60) as watcher:
        assert watcher.stats()["held_blocks"] == 0
    stop_and_check(running)


@pytest.fixture
def http_factory(serve_factory):  # noqa: F811
    """Start bin/serve with given flags (add --http-port 0 / --metrics-port 0 yourself)."""
    started: list[HttpServe] = []

    def start(*args: str) -> HttpServe:
        server = http_serve(serve_factory(*args))
        started.append(server)
        return server

    yield start
    for server in started:
        stop_and_check(server)
