"""A stand-in server for the client tests: a bare ROUTER socket on a thread plays the frontend,
so a test sees exactly what a client sends and controls what (and when) it answers, without
starting a real server."""

from __future__ import annotations

import threading

import msgpack
import zmq

from conveyor.protocol import wire


class RouterStandIn:
    """A ROUTER bound at ``address`` that takes ``expect`` messages (or stops after 10 s of
    silence), records each decoded in :attr:`received`, and sends back what :meth:`answer`
    returns for it, if anything. A subclass sets its own attributes before calling this
    ``__init__``: the serving thread starts in it."""

    #: The reply to ``stats``: an idle server.
    STATS = {"type": wire.STATS_REPLY, "v": 1, "in_flight": 0}

    def __init__(self, address: str, expect: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.expect = expect
        self.received: list[dict] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def answer(self, msg: dict) -> dict | None:
        """The reply to ``msg``, or None to send nothing."""
        raise NotImplementedError

    def _serve(self) -> None:
        while len(self.received) < self.expect and self.sock.poll(10_000):
            identity, payload = self.sock.recv_multipart()
            msg = msgpack.unpackb(payload)
            self.received.append(msg)
            reply = self.answer(msg)
            if reply is not None:
                self.sock.send_multipart([identity, wire.pack(reply)])

    def close(self) -> None:
        self.thread.join(15)
        self.sock.close(linger=0)
        self.ctx.term()
