"""conveyor.client against an address with no server, and against a slow one: "no server at
ADDRESS" within the connect timeout (bin/client and bin/profile say so and exit non-zero,
without a traceback), while a server that is there but slow to answer is waited for. A
stand-in server (a bare ROUTER socket) plays the frontend; no real server is started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conveyor.cli import client as client_cli
from conveyor.cli import profile as profile_cli
from conveyor.client import AsyncClient, Client, NoServerError
from conveyor.protocol import wire
from conveyor.protocol.replies import final_reply
from tests.protocol.stand_in import RouterStandIn

CONNECT_TIMEOUT = 0.5
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def nowhere(tmp_path) -> str:
    """An address nothing listens on."""
    return f"ipc://{tmp_path}/nobody"


def test_client_says_no_server_within_the_connect_timeout(nowhere) -> None:
    with Client(nowhere, timeout=60, connect_timeout=CONNECT_TIMEOUT) as client:
        start = time.monotonic()
        with pytest.raises(NoServerError, match=f"no server at {nowhere}"):
            client.generate("hi", max_tokens=1)
        with pytest.raises(NoServerError):
            client.stats()
    assert time.monotonic() - start < 2 * CONNECT_TIMEOUT + 1


def test_async_client_says_no_server_within_the_connect_timeout(nowhere) -> None:
    async def main() -> None:
        async with AsyncClient(nowhere, timeout=60, connect_timeout=CONNECT_TIMEOUT) as client:
            with pytest.raises(NoServerError, match=f"no server at {nowhere}"):
                await client.generate("hi", max_tokens=1)
            with pytest.raises(NoServerError):
                async for _ in client.stream("hi", max_tokens=1):
                    pass

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 2 * CONNECT_TIMEOUT + 1


@pytest.mark.parametrize("cli", [client_cli, profile_cli])
def test_commands_say_no_server_and_exit_non_zero(cli, nowhere, capsys) -> None:
    args = ["--host", nowhere, "--connect-timeout", str(CONNECT_TIMEOUT)] + (["hi"] if cli is client_cli else [])
    start = time.monotonic()
    assert cli.main(args) == 1
    assert time.monotonic() - start < CONNECT_TIMEOUT + 1
    err = capsys.readouterr().err
    assert f"no server at {nowhere}" in err and "Traceback" not in err


class StandIn(RouterStandIn):
    """Answers a generate with a final after ``delay_s`` (as a long prompt's prefill: nothing
    at all comes meanwhile), and stats with an idle server's map."""

    def __init__(self, address: str, delay_s: float, expect: int) -> None:
        self.delay_s = delay_s
        super().__init__(address, expect)

    def answer(self, msg: dict) -> dict | None:
        if msg["type"] == wire.STATS:
            return self.STATS
        if msg["type"] != wire.GENERATE:
            return None
        time.sleep(self.delay_s)
        timing = {"queue_time": None, "ttft": None, "total": self.delay_s}
        return final_reply(
            msg["request_id"], "ok", [7], "length", None, prompt_tokens=1, cached_tokens=0, timing=timing
        )


def test_a_slow_first_reply_is_waited_for(tmp_path) -> None:
    """Three connect timeouts without a byte from the server: the reply still counts."""
    address = f"ipc://{tmp_path}/slow"
    server = StandIn(address, delay_s=3 * CONNECT_TIMEOUT, expect=1)
    try:
        with Client(address, timeout=30, connect_timeout=CONNECT_TIMEOUT) as client:
            result = client.generate("hi", max_tokens=1)
    finally:
        server.close()
    assert (result.text, result.token_ids) == ("ok", [7])


def test_a_server_that_comes_up_within_the_connect_timeout_is_found(tmp_path) -> None:
    address = f"ipc://{tmp_path}/late"
    servers: list[StandIn] = []
    timer = threading.Timer(0.5, lambda: servers.append(StandIn(address, delay_s=0, expect=1)))
    with Client(address, timeout=30, connect_timeout=5.0) as client:
        timer.start()
        try:
            assert client.generate("hi", max_tokens=1).text == "ok"
        finally:
            timer.join()
            servers[0].close()


def test_stats_asks_for_the_iteration_log_only_when_told(tmp_path) -> None:
    address = f"ipc://{tmp_path}/stats"
    server = StandIn(address, delay_s=0, expect=2)
    try:
        with Client(address, connect_timeout=CONNECT_TIMEOUT) as client:
            client.stats()
            client.stats(iterations=True)
    finally:
        server.close()
    version = wire.CLIENT_PROTOCOL_VERSION
    assert server.received == [
        {"type": wire.STATS, "v": version},
        {"type": wire.STATS, "v": version, "iterations": True},
    ]


def test_an_id_in_flight_is_refused_locally_unless_aborted(tmp_path) -> None:
    """A second generate under an id the client still awaits never reaches the server (its
    refusal could not be told from the running request's replies); after the caller's own
    abort the id is free at once, as the protocol frees it in order."""
    address = f"ipc://{tmp_path}/dup"
    server = StandIn(address, delay_s=0.5, expect=3)
    try:
        with Client(address, timeout=30, connect_timeout=CONNECT_TIMEOUT) as client:
            client._send({"type": wire.GENERATE, "v": 1, "request_id": "r", "prompt": "hi"})
            with pytest.raises(ValueError, match="already in flight"):
                client._send({"type": wire.GENERATE, "v": 1, "request_id": "r", "prompt": "again"})
            client.abort("r")
            client._send({"type": wire.GENERATE, "v": 1, "request_id": "r", "prompt": "reused"})
    finally:
        server.close()
    assert [(m["type"], m.get("prompt")) for m in server.received] == [
        (wire.GENERATE, "hi"),
        (wire.ABORT, None),
        (wire.GENERATE, "reused"),
    ]


@pytest.mark.parametrize("stream", [True, False])
def test_client_json_output_parses_back(tmp_path, capsys, stream) -> None:
    """``bin/client --json`` prints the whole result as one JSON object (the usage and the
    choices nested), streamed or not."""
    address = f"ipc://{tmp_path}/json"
    server = StandIn(address, delay_s=0, expect=1)
    try:
        args = ["--host", address, "--connect-timeout", "5", "--json", "hi"] + ([] if stream else ["--no-stream"])
        assert client_cli.main(args) == 0
    finally:
        server.close()
    out = capsys.readouterr().out
    result = json.loads(out)
    assert (result["text"], result["token_ids"], result["finish_reason"]) == ("ok", [7], "length")
    assert result["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
    assert result["choices"] == [
        {"index": 0, "text": "ok", "token_ids": [7], "finish_reason": "length", "logprobs": None}
    ]


class Silent(RouterStandIn):
    """Takes a generate and never answers it (a long request), then records the abort."""

    def answer(self, msg: dict) -> dict | None:
        return None


def test_ctrl_c_on_the_client_aborts_in_one_line(tmp_path) -> None:
    """Ctrl-C while a request runs: one line on stderr, no traceback, exit 130, and the
    request is aborted on the server."""
    address = f"ipc://{tmp_path}/silent"
    server = Silent(address, expect=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bin" / "client"), "--host", address, "hi"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not server.received and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.received, "the client never sent its request"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        server.close()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["client: interrupted"], err
    assert [m["type"] for m in server.received] == [wire.GENERATE, wire.ABORT]
