"""Issue 43's slowloris finding at CI scale: bin/serve --http-port with short limits
(``--http-header-timeout 1 --http-body-timeout 1 --http-max-connections 40``).

- many connections that send half a request line and stop: past the cap, new connections get
  an immediate 503 (``Connection: close``), never a hang; each half-open one is closed within
  the header timeout (plus a margin), and a well-behaved client is served meanwhile as soon
  as there is room, ``/health`` too, within a second or so of its idle latency;
- a connection that sends nothing, and a keep-alive connection idle after a response, are
  closed at the header timeout; a body that stops half-way is answered 408;
- each cause is counted in /metrics (``conveyor:http_connections_closed_total{cause}``) and
  logged once.
Before: no timeout, no cap; 20,000 half-open connections exhausted the descriptors and every
request and /health failed, with nothing logged.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.http.test_raw_http import request

LIMITS = ("--http-header-timeout", "1", "--http-body-timeout", "1", "--http-max-connections", "40")


@pytest.fixture(scope="module")
def limited(tiny_checkpoint, tmp_path_factory):
    from tests.e2e.serve_harness import ServeProcess
    from tests.http.conftest import SERVE_ARGS, http_serve, stop_and_check

    serve = ServeProcess(
        ["--model", str(tiny_checkpoint), *SERVE_ARGS, "--http-port", "0", *LIMITS], tmp_path_factory.mktemp("slow")
    )
    server = http_serve(serve)
    yield server
    stop_and_check(server)


def _connect(server) -> socket.socket:
    parts = urlsplit(server.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
    return sock


def _read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sends until it closes, and when it closed (seconds from now)."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, float("inf")
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def _closed_counts(server) -> dict[str, float]:
    status, _ = request(server, "GET", "/health")
    assert status == 200
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = _read_all(sock, 10)[0].decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("conveyor:http_connections_closed_total{"):
            cause = line.split('cause="')[1].split('"')[0]
            counts[cause] = float(line.rsplit(" ", 1)[1])
    return counts


def _timed_request(server) -> float:
    start = time.monotonic()
    status, body = request(
        server, "POST", "/v1/completions", {"model": server_model(server), "prompt": "hi", "max_tokens": 2}
    )
    assert status == 200, body
    return time.monotonic() - start


def server_model(server) -> str:
    return request(server, "GET", "/v1/models")[1]["data"][0]["id"]


def test_slowloris_is_capped_and_cut_off_while_others_are_served(limited) -> None:
    alone = min(_timed_request(limited) for _ in range(3))
    before = _closed_counts(limited)
    half_open = []
    for _ in range(40):
        sock = _connect(limited)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        half_open.append(sock)
    time.sleep(0.2)
    # Past the cap: answered at once with a 503, closed.
    extra = _connect(limited)
    data, closed_after = _read_all(extra, 5)
    assert data.startswith(b"HTTP/1.1 503") and b"too_many_connections" in data, data
    assert closed_after < 1.0
    extra.close()
    # The half-open ones are closed within the header timeout (1 s) plus a margin.
    start = time.monotonic()
    for sock in half_open:
        data, _ = _read_all(sock, max(0.1, 4 - (time.monotonic() - start)))
        assert data == b"", data  # closed without an answer
        sock.close()
    assert time.monotonic() - start < 4
    # Served again, /health too, at about its idle latency.
    during = _timed_request(limited)
    assert during < alone + 1.0, (during, alone)
    after = _closed_counts(limited)
    assert after["header_timeout"] - before["header_timeout"] >= 40
    assert after["refused"] - before["refused"] >= 1
    log = limited.serve.output()
    assert log.count("did not finish a request's headers") == 1, log[-3000:]


def test_silent_idle_and_slow_body_connections_are_closed(limited) -> None:
    before = _closed_counts(limited)
    silent = _connect(limited)
    _, closed_after = _read_all(silent, 5)
    assert closed_after < 3, closed_after  # never spoke: closed at the header timeout
    silent.close()
    keep = _connect(limited)
    keep.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive by default
    data, closed_after = _read_all(keep, 5)
    assert data.startswith(b"HTTP/1.1 200") and closed_after < 3, (data, closed_after)
    keep.close()
    slow = _connect(limited)
    slow.sendall(
        b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mo'
    )
    data, closed_after = _read_all(slow, 5)
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data and closed_after < 3, (data, closed_after)
    slow.close()
    after = _closed_counts(limited)
    assert after["idle_timeout"] - before["idle_timeout"] >= 2
    assert after["body_timeout"] - before["body_timeout"] == 1
