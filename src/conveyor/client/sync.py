"""The synchronous client: :class:`Client`, the I/O over :class:`~conveyor.client.connection._Connection`
(a blocking socket and a poller; replies for the client's other requests are buffered)."""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

import zmq

from conveyor.client.connection import (
    CONTROL_KEYS,
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


class Client(Connection):
    """Synchronous client. Replies for other requests of this client are buffered, not lost."""

    _CONTEXT = zmq.Context

    def _init_delivery(self) -> None:
        self._inbox: dict[str | None, collections.deque] = collections.defaultdict(collections.deque)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _deliver(self, key: str | None, reply: dict[str, Any]) -> None:
        self._inbox[key].append(reply)

    def _complete(self, msg: dict[str, Any]) -> CompletionResult:
        self._send(msg)
        try:
            while True:
                reply = self._next(msg["request_id"])
                if reply["type"] == wire.FINAL:
                    return completion_result(reply)
        except KeyboardInterrupt:  # nobody waits for it any more: free the server's work
            self._abandon(msg["request_id"])
            raise

    def _stream(self, msg: dict[str, Any]) -> Iterator[StreamDelta]:
        self._send(msg)
        finished = False
        try:
            while not finished:
                delta = to_delta(self._next(msg["request_id"]))
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:  # the caller stopped iterating early: free the server's work
                self._abandon(msg["request_id"])

    def _abort(self, request_id: str) -> None:
        self._send(abort_message(request_id))
        self._aborted.add(request_id)

    def _command(self, key: str, msg: dict[str, Any]) -> dict[str, Any]:
        self._send(msg)
        return self._next(key)

    def close(self) -> None:
        self._close_socket()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, msg: dict[str, Any]) -> None:
        data = pack_request(msg)
        self._take_events()  # a loss or a handshake since the last look
        key = awaited_key(msg, self._awaiting, self._abandoned, self._aborted)
        if not self._connected and self.connect_timeout is not None:
            self._await_server()
        self._sock.send(data)
        if key is not None:
            self._awaiting.add(key)

    def _await_server(self) -> None:
        """Wait up to ``connect_timeout`` for the handshake with the server; a refusal raises
        at once (a ZeroMQ client retries forever, and is refused every time)."""
        deadline = time.monotonic() + self.connect_timeout
        while not self._connected:
            remaining = deadline - time.monotonic()
            if self._refusal is not None or remaining <= 0:
                raise self._not_connected()
            if self._monitor.poll(max(1, int(remaining * 1000))):
                self._take_events()

    def _take_events(self) -> None:
        """Handle every queued monitor event; on the loss of the server, first take the replies
        that arrived before it, then fail every request still waiting (ServerGoneError)."""
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._on_event(frames):
                self._take_replies(limit=None)
                self._fail_awaiting()

    def _take_replies(self, limit: int | None = DRAIN_MAX) -> None:
        """Buffer the replies already received, at most ``limit`` (None: all); an error that
        names neither a request nor a command raises."""
        for _ in itertools.count() if limit is None else range(limit):
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = wire.unpack_map(raw)
            if unaddressed_error(reply):
                check_error(reply)
            self._route(reply)

    def _abandon(self, request_id: str) -> None:
        """Abort a request nobody will read any more; its late replies are dropped on arrival
        (see :meth:`Connection._mark_abandoned`)."""
        self._inbox.pop(request_id, None)
        if not self._mark_abandoned(request_id):
            return
        try:
            self._sock.send(pack_request(abort_message(request_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the queue to a server long gone is full; the server drops a lost connection's requests itself

    def _next(self, key: str) -> dict[str, Any]:
        """The next message for ``key`` (a request id, or "__stats__"), buffering others."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not self._inbox[key]:
            wait = None if deadline is None else deadline - time.monotonic()
            ready = dict(self._poller.poll(None if wait is None else max(0, math.ceil(wait * 1000))))
            if self._sock in ready:
                self._take_replies()
            if self._monitor in ready:
                self._take_events()
            if not ready and deadline is not None and time.monotonic() >= deadline:
                if key not in CONTROL_KEYS.values():
                    self._abandon(key)
                raise TimeoutError(f"no reply from {self.address} within {self.timeout} s")
        reply = self._inbox[key].popleft()
        if not self._inbox[key]:
            del self._inbox[key]
        check_error(reply)  # a lost connection's marker
        return reply
