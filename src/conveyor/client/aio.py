"""The asyncio client: :class:`AsyncClient`, the I/O over :class:`~conveyor.client.connection._Connection`
(one reader task routes replies to the awaiting request's queue; a watcher task reads the monitor)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from conveyor.client.connection import (
    DRAIN_MAX,
    CompletionResult,
    Connection,
    StreamDelta,
    abort_message,
    awaited_key,
    check_error,
    completion_result,
    pack_request,
    to_delta,
    unaddressed_error,
)
from conveyor.protocol import wire


class AsyncClient(Connection):
    """asyncio client: one reader task routes replies to the awaiting request."""

    _CONTEXT = zmq.asyncio.Context

    def _init_delivery(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None  # reads the monitor (see _watch_loop)
        self._link_changed: asyncio.Event | None = None  # set by the watcher after each event

    async def _complete(self, msg: dict[str, Any]) -> CompletionResult:
        async with self._request(msg["request_id"]) as queue:
            await self._send(msg)
            try:
                while True:
                    reply = await self._next(queue, msg["request_id"])
                    if reply["type"] == wire.FINAL:
                        return completion_result(reply)
            except asyncio.CancelledError:  # e.g. wait_for() gave up on it: free the server's work
                await self._abandon(msg["request_id"], queue)
                raise

    async def _stream(self, msg: dict[str, Any]) -> AsyncIterator[StreamDelta]:
        finished = False
        async with self._request(msg["request_id"]) as queue:
            await self._send(msg)
            try:
                while True:
                    delta = to_delta(await self._next(queue, msg["request_id"]))
                    if delta.finish_reason is not None:
                        finished = True
                        break
                    yield delta
            finally:
                if not finished:  # the caller stopped iterating early: free the server's work
                    await self._abandon(msg["request_id"], queue)
        # The final is handed over once its id is free on this client, so a caller that stops
        # at it (without iterating to the end or closing the stream) may reuse the id at once.
        yield delta

    async def _abort(self, request_id: str) -> None:
        await self._send(abort_message(request_id))
        self._aborted.add(request_id)

    async def _command(self, key: str, msg: dict[str, Any]) -> dict[str, Any]:
        async with self._request(key) as queue:
            await self._send(msg)
            return await self._next(queue, None)

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._close_socket()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _request(self, key: str):
        client = self

        class _Registration:
            async def __aenter__(self) -> asyncio.Queue:
                if key in client._queues:
                    raise ValueError(f"request id {key!r} is already in flight on this client")
                client._queues[key] = asyncio.Queue()
                if client._reader is None or client._reader.done():
                    client._reader = asyncio.ensure_future(client._read_loop())
                return client._queues[key]

            async def __aexit__(self, *exc: object) -> None:
                client._queues.pop(key, None)

        return _Registration()

    async def _send(self, msg: dict[str, Any]) -> None:
        data = pack_request(msg)
        if self._watcher is None or self._watcher.done():
            self._link_changed = asyncio.Event()
            self._watcher = asyncio.ensure_future(self._watch_loop())
            await asyncio.sleep(0)  # let it take the events queued so far
        if not self._connected and self.connect_timeout is not None:
            await self._await_server()
        key = awaited_key(msg, self._awaiting, self._abandoned, self._aborted)
        if key is not None:  # before the send: its reply may be routed before this task resumes
            self._awaiting.add(key)
        try:
            await self._sock.send(data)
        except BaseException:
            self._awaiting.discard(key)
            raise

    async def _await_server(self) -> None:
        """As :meth:`Client._await_server`: the watcher reads the events, every sender waits."""
        deadline = time.monotonic() + self.connect_timeout
        while not self._connected:
            remaining = deadline - time.monotonic()
            if self._refusal is not None or remaining <= 0:
                raise self._not_connected()
            self._link_changed.clear()
            try:
                await asyncio.wait_for(self._link_changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def _watch_loop(self) -> None:
        """Read the monitor for as long as the client lives. On the loss of the server, the
        replies that arrived before it are routed first, then every request still waiting
        gets the loss (ServerGoneError in its ``_next``)."""
        while True:
            frames = await self._monitor.recv_multipart()
            if self._on_event(frames):
                self._route_received()
                self._fail_awaiting()
            self._link_changed.set()

    def _route_received(self) -> None:
        """Route every reply already received, without waiting (a synchronous shadow's
        receives; the reader's pending receive just finds them gone)."""
        drain = zmq.Socket.shadow(self._sock.underlying)
        while True:
            try:
                raw = drain.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._route(wire.unpack_map(raw))

    async def _read_loop(self) -> None:
        # One asyncio receive per wake-up, then whatever else is queued by plain non-blocking
        # receives on a synchronous shadow of the socket: a server iteration sends a delta
        # for every stream at once, and each asyncio receive costs a future and its poller
        # bookkeeping. (The asyncio socket tries an immediate receive before it waits, so
        # messages the shadow leaves are never missed.) At most DRAIN_MAX at a time, so a
        # flood never keeps the loop from the tasks the replies wake.
        drain = zmq.Socket.shadow(self._sock.underlying)
        try:
            while True:
                self._route(wire.unpack_map(await self._sock.recv()))
                for _ in range(DRAIN_MAX):
                    try:
                        raw = drain.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._route(wire.unpack_map(raw))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surface a dead reader to every waiter
            for queue in self._queues.values():
                queue.put_nowait({"type": wire.ERROR, "message": f"client reader failed: {exc}"})

    def _route(self, reply: dict[str, Any]) -> None:
        """As :meth:`Connection._route`, but an error that names neither a request nor a
        command goes to every queue (the synchronous client raises it from its receive
        instead); one that names a command goes to that command's caller alone."""
        if unaddressed_error(reply):
            for queue in self._queues.values():
                queue.put_nowait(reply)
            return
        super()._route(reply)

    def _deliver(self, key: str | None, reply: dict[str, Any]) -> None:
        queue = self._queues.get(key)
        if queue is not None:
            queue.put_nowait(reply)

    async def _next(self, queue: asyncio.Queue, request_id: str | None) -> dict[str, Any]:
        try:
            reply = await asyncio.wait_for(queue.get(), self.timeout)
        except asyncio.TimeoutError:
            if request_id is not None:
                await self._abandon(request_id, queue)
            raise TimeoutError(f"no reply from {self.address} within {self.timeout} s") from None
        check_error(reply)
        return reply

    async def _abandon(self, request_id: str, queue: asyncio.Queue) -> None:
        """Abort a request nobody will read any more (as :meth:`Client._abandon`): the reader
        drops its replies up to its final, so a later request reusing the id never gets them."""
        while not queue.empty():
            queue.get_nowait()
        if not self._mark_abandoned(request_id):  # (no await in it: the reader cannot interleave)
            return  # its final came already, or the connection was lost: nothing more will come
        try:
            await self._sock.send(pack_request(abort_message(request_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the queue to a server long gone is full; the server drops a lost connection's requests itself
