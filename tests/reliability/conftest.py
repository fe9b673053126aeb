"""Fixtures of the reliability tests: a killable stand-in server (tests.reliability.fake_server),
one bin/serve shared by a module's tests (``server``), and tests/e2e's ``serve_factory`` and
``tiny_checkpoint`` (bin/serve as a user runs it), imported so that pytest registers them for
this package too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import serve_factory, tiny_checkpoint  # noqa: F401  (fixtures, registered here)
from tests.e2e.serve_harness import REPO, ServeProcess, still_alive_after

# The server the reliability tests attack: the tiny checkpoint, a small KV pool, one thread.
SERVE_ARGS = ("--num-kv-blocks", "96", "--block-size", "8", "--threads", "1", "--max-num-batched-tokens", "256")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """bin/serve (SERVE_ARGS) for all of a module's tests, since a start costs seconds; after
    them it must stop cleanly on SIGTERM (exit 0) and leave none of its processes behind."""
    srv = ServeProcess(["--model", str(tiny_checkpoint), *SERVE_ARGS], tmp_path_factory.mktemp("serve"))
    yield srv
    kids = list(srv.pids.values())
    assert srv.terminate() == 0, srv.output()
    assert not still_alive_after(kids, 10), "processes left behind"


class FakeServer:
    """tests.reliability.fake_server in a subprocess, bound and ready."""

    def __init__(self, address: str, *args: str) -> None:
        self.address = address
        cmd = [sys.executable, "-m", "tests.reliability.fake_server", address, *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"fake server did not start: {line}{self.proc.stderr.read()}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def fake_server(tmp_path):
    """Start fake servers on ipc addresses in tmp_path (``name``, then fake_server's flags);
    every one is killed at the end."""
    started: list[FakeServer] = []

    def start(*args: str, name: str = "client.sock") -> FakeServer:
        server = FakeServer(f"ipc://{tmp_path}/{name}", *args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
