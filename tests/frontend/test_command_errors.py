"""A refused or unanswerable ``stats`` / ``profile`` / ``metrics`` carries no request id, so its
``error`` map names the command: a client routes it to the call waiting for that command's
answer, which raises instead of waiting for a reply that never comes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conveyor.client import AsyncClient, Client, ServerError
from conveyor.client.connection import CONTROL_KEYS
from conveyor.ipc.messages import AddRequest, StatsQuery
from conveyor.protocol import wire
from conveyor.protocol.requests import parse_client_message


@pytest.mark.parametrize(
    ("message", "command"),
    [
        ({"type": "stats", "iterations": "yes"}, "stats"),
        ({"type": "stats", "v": 2}, "stats"),
        ({"type": "profile", "window_s": -1}, "profile"),
        ({"type": "metrics", "extra": 1}, "metrics"),
        ({"type": "generate", "prompt": 3}, None),
        ({"type": "abort"}, None),
        ({"type": ["stats"]}, None),
    ],
)
def test_a_refusal_names_the_command_it_refuses(message, command) -> None:
    with pytest.raises(wire.ProtocolError) as caught:
        parse_client_message(message)
    assert caught.value.command == command


def test_a_refused_command_gets_an_error_naming_it(live_frontend) -> None:
    fe = live_frontend()
    sock = fe.client()
    fe.send(sock, type="stats", iterations="yes")
    reply = fe.recv(sock)
    assert reply["type"] == "error" and reply["code"] == "invalid_field" and reply["command"] == "stats", reply
    assert reply["request_id"] is None
    fe.send(sock, type="abort")  # carries no command: routed by id, which it lacks
    assert "command" not in fe.recv(sock)


def _call(fn, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as exc:  # noqa: BLE001 (what the caller sees is the assertion)
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_stats_call_the_server_cannot_answer_raises_at_once(live_frontend) -> None:
    """The server shuts down while the client's stats() waits for the schedulers: it gets the
    server's error as a ServerError, long before its own timeout."""
    fe = live_frontend()
    with Client(fe.addresses.client, timeout=60) as client:
        out: dict = {}
        thread = _call(client.stats, out)
        assert isinstance(fe.scheduler_recv(), StatsQuery)
        fe.shutdown()
        thread.join(10)
        assert not thread.is_alive(), "stats() is still waiting"
        assert isinstance(out.get("error"), ServerError), out
        assert out["error"].code == "server_error" and str(out["error"]) == "test over"


def test_a_refused_command_fails_its_caller_alone(live_frontend) -> None:
    """AsyncClient with a request in flight: a refused stats raises from stats() and leaves the
    request waiting for its own replies (an error naming no request would reach every caller)."""
    fe = live_frontend()

    async def scenario() -> None:
        async with AsyncClient(fe.addresses.client, timeout=30) as client:
            running = asyncio.ensure_future(client.generate("hello", request_id="g1", max_tokens=2))
            added = await asyncio.to_thread(fe.scheduler_recv)
            assert isinstance(added, AddRequest)
            bad_stats = {"type": wire.STATS, "v": wire.CLIENT_PROTOCOL_VERSION, "iterations": "yes"}
            with pytest.raises(ServerError, match="iterations"):
                await client._command(CONTROL_KEYS[wire.STATS_REPLY], bad_stats)  # a client that sends a bad one
            await asyncio.sleep(0.2)
            assert not running.done(), running
            running.cancel()

    asyncio.run(scenario())
