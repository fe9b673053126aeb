"""Sending to clients on the frontend's ROUTER socket, from the hot path and from tasks.

Two views of the one socket. :attr:`ClientSender.raw` is a synchronous shadow of it: a raw
send costs a fraction of an awaited send of the asyncio wrapper, which matters once per
streamed token. A raw send can consume the edge-triggered wake-up of client messages that
arrive meanwhile; :meth:`conveyor.frontend.server.Frontend.run` re-checks every socket each
time it polls, so raw sends (:meth:`ClientSender.push`) are safe from the handlers it calls,
and only from those. Anything else (tasks, timers) sends through :meth:`ClientSender.send`,
whose asyncio socket re-checks.

Every send is ``NOBLOCK``, and each can fail on its identity frame, before any frame is
queued (``ROUTER_MANDATORY``), in one of two ways, both handled by :meth:`ClientSender.failed`:

- ``EHOSTUNREACH``: the client is gone. The reply is dropped and the identity goes to
  ``on_gone``, which aborts that client's requests (what the disconnect event does too).
- ``EAGAIN``: the connection's send queue is full (``--client-send-queue`` replies,
  :data:`conveyor.ipc.transport.CLIENT_SEND_QUEUE`): the client has stopped reading. The
  reply is dropped and the identity goes to ``on_full``, which treats the connection as gone
  (its requests aborted, no final: it could not be queued anyway). Without this the queue of
  a client that never reads grew for as long as its requests ran.

Either way the sender goes on with the next client.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from conveyor import profiling
from conveyor.protocol import wire

# The backend's send, without pyzmq's pure-Python wrapper around it (same call for bytes with
# copy=True; that wrapper cost about a microsecond per call on the hot path).
backend_send = zmq.backend.Socket.send
# The identity frame's flags: it fails, rather than blocks, when the client's queue is full.
IDENTITY_FLAGS = zmq.SNDMORE | zmq.NOBLOCK


class ClientSender:
    """The frontend's sends to clients; ``client_send`` times them."""

    def __init__(
        self,
        clients: zmq.asyncio.Socket,
        on_gone: Callable[[bytes], None],
        on_full: Callable[[bytes], None],
        profiler: profiling.Profiler,
    ) -> None:
        self._clients = clients
        self.raw = zmq.Socket.shadow(clients.underlying)
        self.on_gone = on_gone
        self.on_full = on_full
        self.timer = profiler.timer("client_send", trace=False)
        self._packer = msgpack.Packer(use_bin_type=True)  # wire.pack's format, without a Packer per call

    def push(self, identity: bytes, payload: bytes) -> None:
        """Send packed bytes to one client now, on the raw socket: only from the handlers
        :meth:`Frontend.run` calls (anywhere else: :meth:`send`)."""
        start = profiling.now_ns()
        raw = self.raw
        try:
            backend_send(raw, identity, IDENTITY_FLAGS)  # a gone or full client fails here, before any frame is queued
        except zmq.ZMQError as exc:
            self.failed(identity, exc)
            return
        backend_send(raw, payload)
        self.timer.record(start)

    def failed(self, identity: bytes, exc: zmq.ZMQError) -> None:
        """A send to ``identity`` raised ``exc`` on its identity frame (nothing was queued): the
        reply is dropped; a gone client goes to ``on_gone``, a full queue to ``on_full``; any
        other error is a bug and raised again."""
        if exc.errno == errno.EHOSTUNREACH:
            self.on_gone(identity)
        elif exc.errno == errno.EAGAIN:
            self.on_full(identity)
        else:
            raise exc

    def push_map(self, identity: bytes, obj: dict[str, Any]) -> None:
        """:meth:`push` of a protocol map."""
        self.push(identity, self._packer.pack(obj))

    async def send(self, identity: bytes, obj: dict[str, Any]) -> None:
        """Send a protocol map to one client through the asyncio socket: safe from tasks and timers too."""
        start = profiling.now_ns()
        try:
            await self._clients.send_multipart([identity, wire.pack(obj)], flags=zmq.NOBLOCK, copy=False)
            self.timer.record(start)
        except zmq.ZMQError as exc:
            self.failed(identity, exc)
