"""The clients never hang on a server that is gone: killed, stopped, never there, or
unreachable under a routing id another connection holds (issue 17, "silent hangs").

A stand-in server (tests.reliability.fake_server, the frontend's own client-socket setup)
keeps every request in flight after its first delta, so only the client's liveness handling
can end them: a request timeout far longer than the liveness bounds makes a ``TimeoutError``
(instead of :class:`ServerGoneError`) the failure.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from conveyor.client import AsyncClient, Client, NoServerError, ServerGoneError
from conveyor.protocol import limits

REQUEST_TIMEOUT_S = 60.0  # far past every bound below: reaching it is the failure
NUM_STREAMS = 20


async def _streams_in_flight(client: AsyncClient, n: int) -> list[asyncio.Task]:
    """``n`` streams, each past its first delta (so in flight at the server)."""
    first = asyncio.Semaphore(0)

    async def one(i: int) -> None:
        async for _ in client.stream(prompt=f"p{i}", request_id=f"r{i}"):
            first.release()

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    for _ in tasks:
        await first.acquire()
    return tasks


def test_killed_server_fails_every_stream(fake_server) -> None:
    """kill -9 with 20 streams in flight: each fails with ServerGoneError, well within 5 s."""
    server = fake_server()

    async def scenario():
        async with AsyncClient(server.address, timeout=REQUEST_TIMEOUT_S) as client:
            tasks = await _streams_in_flight(client, NUM_STREAMS)
            start = time.monotonic()
            os.kill(server.proc.pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - start

    results, took = asyncio.run(scenario())
    assert all(isinstance(r, ServerGoneError) for r in results), results
    assert "lost the connection" in str(results[0]) and "request 'r0'" in str(results[0])
    assert took < 5.0, took


def test_stopped_server_is_found_dead_by_heartbeat(fake_server) -> None:
    """SIGSTOP: the connection stays open but nothing answers, not even libzmq's I/O thread;
    the heartbeat gives up after ``liveness_timeout`` and every stream fails."""
    server = fake_server()

    async def scenario():
        async with AsyncClient(server.address, timeout=REQUEST_TIMEOUT_S, liveness_timeout=1.0) as client:
            tasks = await _streams_in_flight(client, 4)
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                return await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)

    results = asyncio.run(scenario())
    assert all(isinstance(r, ServerGoneError) for r in results), results


def test_sync_client_fails_a_pending_request_and_reconnects(fake_server, tmp_path) -> None:
    """The synchronous client too; afterwards a new server at the address serves it again."""
    server = fake_server()
    with Client(server.address, timeout=REQUEST_TIMEOUT_S) as client:
        stream = client.stream(prompt="p", request_id="held")
        assert next(stream).text == "x"
        os.kill(server.proc.pid, signal.SIGKILL)
        with pytest.raises(ServerGoneError):
            next(stream)
        server.proc.wait(10)
        os.unlink(server.address.removeprefix("ipc://"))
        fake_server("--answer")
        result = client.generate(prompt="again", request_id="held")  # the lost id is free again
        assert result.finish_reason == "stop" and result.token_ids == [1]


def test_no_server_fails_within_connect_timeout(tmp_path) -> None:
    address = f"ipc://{tmp_path}/nobody.sock"
    with Client(address, connect_timeout=0.5) as client:
        with pytest.raises(NoServerError, match="no server at"):
            client.generate(prompt="p")

    async def scenario():
        async with AsyncClient(address, connect_timeout=0.5) as client:
            await client.generate(prompt="p")

    with pytest.raises(NoServerError):
        asyncio.run(scenario())


def test_a_reused_routing_id_takes_the_connection_over(fake_server) -> None:
    """A second socket with a connected routing id (a client reconnecting with its stable
    identity before the server saw the old connection go) is served, not ignored."""
    server = fake_server("--answer")
    with Client(server.address, timeout=5, identity=b"stable-id") as first:
        assert first.generate(prompt="a").finish_reason == "stop"
        with Client(server.address, timeout=5, identity=b"stable-id") as second:
            assert second.generate(prompt="b").finish_reason == "stop"


def test_oversized_messages(fake_server) -> None:
    """The client refuses a message over the protocol's limit before sending it; a raw frame
    far over it makes the server drop that connection unread, and it serves others on."""
    server = fake_server("--answer")
    with Client(server.address, timeout=5) as client:
        with pytest.raises(ValueError, match="exceeds the protocol's limit"):
            client.generate(prompt="x" * (limits.MAX_CLIENT_MESSAGE_BYTES + 1))
        assert client.generate(prompt="after").finish_reason == "stop"  # nothing was sent
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        monitor = raw.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        raw.connect(server.address)
        try:
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            raw.send(b"\x00" * (64 * 2**20))
            assert monitor.poll(10_000), "the server kept a connection that sent 64 MiB in one frame"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            raw.disable_monitor()
            monitor.close(linger=0)
            raw.close(linger=0)
        assert client.generate(prompt="still").finish_reason == "stop"
