"""A worker that stops stepping while work is queued (SIGSTOP) is noticed within
``--hang-timeout`` (issue 43; docs/reliability.md, "Faults"): the requests in flight fail with
an error naming the hang, ``/health`` turns 503, and ``--on-hang`` chooses what follows:
``wait`` refuses new requests until the worker steps again, then serves; ``exit`` stops the
server (exit status 1, nothing left behind). Before: requests waited for their client's own
timeout while ``/health`` answered 200.
"""

from __future__ import annotations

import os
import signal
import time

from conveyor.client import Client
from tests.e2e.serve_harness import ServeProcess, children_of, still_alive_after
from tests.http.conftest import http_serve
from tests.http.test_raw_http import request
from tests.reliability.conftest import SERVE_ARGS

HANG_TIMEOUT_S = 2.0
NOTICE_BOUND_S = HANG_TIMEOUT_S + 2.0  # the timeout, a poll slice and this busy machine's slack


def _stream_then_stop_worker(server: ServeProcess, victim: str = "worker") -> tuple[object, float]:
    """A long stream; once it has its first tokens, SIGSTOP ``victim``. Its final, and how
    long after the SIGSTOP it came."""
    with Client(server.address, timeout=60) as client:
        stream = client.stream(prompt="the hung worker", max_tokens=200, ignore_eos=True)
        next(stream)
        os.kill(server.pids[victim], signal.SIGSTOP)
        stopped = time.monotonic()
        final = None
        for delta in stream:
            if delta.result is not None:
                final = delta.result
        return final, time.monotonic() - stopped


def _completion(server) -> tuple[int, dict]:
    model = request(server, "GET", "/v1/models")[1]["data"][0]["id"]
    return request(server, "POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})


def test_on_hang_wait_fails_requests_and_serves_again_once_the_worker_steps(tiny_checkpoint, tmp_path) -> None:
    args = [
        "--model",
        str(tiny_checkpoint),
        *SERVE_ARGS,
        "--http-port",
        "0",
        "--hang-timeout",
        str(HANG_TIMEOUT_S),
        "--on-hang",
        "wait",
    ]
    serve = ServeProcess(args, tmp_path)
    server = http_serve(serve)
    tree = children_of(serve.proc.pid)
    try:
        assert request(server, "GET", "/health")[0] == 200
        final, took = _stream_then_stop_worker(serve)
        assert final is not None and final.finish_reason == "error" and "worker hung" in final.error, final
        assert took < NOTICE_BOUND_S, took
        status, body = request(server, "GET", "/health")
        assert status == 503, body
        status, body = _completion(server)
        assert status == 503 and body["error"]["code"] == "worker_hung", body
        os.kill(serve.pids["worker"], signal.SIGCONT)
        deadline = time.monotonic() + 10
        while request(server, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, serve.output()[-3000:]
            time.sleep(0.1)
        assert _completion(server)[0] == 200
        assert "stepping again" in serve.output()
    finally:
        os.kill(serve.pids["worker"], signal.SIGCONT)
        serve.shut_down(tree)


def _hang_exits_the_server(serve: ServeProcess, victim: str, said: str) -> None:
    """With ``--on-hang exit``: once ``victim`` is stopped, its stream fails naming it within the
    notice bound, bin/serve exits 1 saying ``said``, and no process of its tree is left."""
    tree = children_of(serve.proc.pid)
    try:
        final, took = _stream_then_stop_worker(serve, victim)
        assert final is not None and final.finish_reason == "error" and f"{victim} hung" in final.error, final
        assert took < NOTICE_BOUND_S, took
        assert serve.proc.wait(20) == 1
        assert said in serve.output()
        assert not still_alive_after(tree, 5)
    finally:
        if serve.proc.poll() is None:
            serve.kill()


def test_on_hang_exit_fails_requests_and_stops_the_server(tiny_checkpoint, tmp_path) -> None:
    args = ["--model", str(tiny_checkpoint), *SERVE_ARGS, "--hang-timeout", str(HANG_TIMEOUT_S)]
    _hang_exits_the_server(ServeProcess(args, tmp_path), "worker", "its worker hung")


def test_a_hung_scheduler_is_noticed_by_the_frontend(tiny_checkpoint, tmp_path) -> None:
    """SIGSTOP of the scheduler: ``wait`` fails its requests and refuses new ones until it runs
    again; then (SIGCONT) it serves; ``exit`` (a second server) stops the server, exit status 1."""
    args = ["--model", str(tiny_checkpoint), *SERVE_ARGS, "--hang-timeout", str(HANG_TIMEOUT_S)]
    (tmp_path / "wait").mkdir()
    (tmp_path / "exit").mkdir()
    serve = ServeProcess([*args, "--on-hang", "wait"], tmp_path / "wait")
    tree = children_of(serve.proc.pid)
    try:
        final, took = _stream_then_stop_worker(serve, "scheduler")
        assert final is not None and final.finish_reason == "error" and "scheduler hung" in final.error, final
        assert took < NOTICE_BOUND_S, took
        with Client(serve.address, timeout=30) as client:
            refused = client.generate(prompt="meanwhile", max_tokens=2)
            assert refused.finish_reason == "error" and "scheduler hung" in refused.error, refused
            os.kill(serve.pids["scheduler"], signal.SIGCONT)
            deadline = time.monotonic() + 10
            while (result := client.generate(prompt="again", max_tokens=2)).finish_reason == "error":
                assert time.monotonic() < deadline, result
                time.sleep(0.2)
            assert result.finish_reason == "length"
    finally:
        os.kill(serve.pids["scheduler"], signal.SIGCONT)
        serve.shut_down(tree)
    _hang_exits_the_server(ServeProcess(args, tmp_path / "exit"), "scheduler", "a scheduler hung")
