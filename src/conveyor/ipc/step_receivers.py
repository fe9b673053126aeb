"""The reading end of the scheduler <-> worker step channel (:mod:`conveyor.ipc.step_channel`
has the channel's description, its rings and the writing end): :class:`StepReceiver` and its
transports, the ring (:class:`RingReceiver`), ZeroMQ (:class:`ZmqReceiver`) and a reader on
another node over TCP (:class:`RemoteReceiver`). The rules on a received message's lifetime
and on a crashed peer are in :mod:`conveyor.ipc.step_channel`'s docstring.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from conveyor.ipc import codec, transport
from conveyor.ipc.shm_ring import Diverted, RingClosed, RingReader, WriterDied
from conveyor.ipc.step_channel import DIVERTED_TIMEOUT_MS, ChannelSpec, PeerGone


class StepReceiver:
    """The reading end of one direction, as reader ``reader`` (a tensor-parallel rank) of the
    channel's ``readers``: ``recv`` in a loop, or wait in the caller's poller::

        poller.register(rx.pollable(), zmq.POLLIN)
        if not rx.arm():          # nothing there yet: sleep until rung (or something else)
            poller.poll(timeout)
        rx.disarm()
        msg = rx.recv(0)          # None if nothing came

    ``StepReceiver(ctx, spec, bind=...)`` builds the transport ``spec`` names, once: a
    :class:`RemoteReceiver` for a reader on another node, a :class:`RingReceiver` when the
    channel has a ring, else a :class:`ZmqReceiver`. Every method
    that asks for the next message (``recv``, ``arm``, ``wait``, ``spin``, ``ready``)
    first releases the previous one: asking for the next means being done with the last.
    """

    def __new__(cls, ctx: zmq.Context, spec: ChannelSpec, *, bind: bool, reader: int = 0) -> StepReceiver:
        if cls is StepReceiver:
            if spec.is_remote(reader):
                cls = RemoteReceiver
            else:
                cls = ZmqReceiver if spec.ring_path is None else RingReceiver
        return super().__new__(cls)

    def __init__(self, ctx: zmq.Context, spec: ChannelSpec, *, bind: bool, reader: int = 0) -> None:
        self._sock = transport.socket(ctx, zmq.PULL, spec.reader_address(reader), bind=bind)

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next message, decoded (None if none came within ``timeout_s``; None waits forever).

        Raises codec.DecodeError for a malformed message (it is consumed), PeerGone when the
        sending process is gone or closed the ring.
        """
        raise NotImplementedError

    def release(self) -> None:
        """Free the slot of the message last received (its array views must no longer be used)."""

    def pollable(self) -> zmq.Socket | int:
        """What to register in a zmq.Poller to wake on a message (after :meth:`arm`)."""
        raise NotImplementedError

    def arm(self) -> bool:
        """Ask to be woken through :meth:`pollable`; True if a message is already there."""
        raise NotImplementedError

    def disarm(self) -> None:
        """Stop asking to be woken (after :meth:`arm`)."""

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: forever) for a message without taking it; True if
        one is there. Raises PeerGone like :meth:`recv`."""
        raise NotImplementedError

    def spin(self) -> bool:
        """Wait for a message by spinning only (``spin_us``, no system call); True if one came.
        A step's result often follows within microseconds: cheaper than a doorbell wake-up."""
        return self.ready()

    def ready(self) -> bool:
        """Whether a message is waiting (never blocks)."""
        raise NotImplementedError

    def peer_alive(self) -> bool:
        """False once the sending process is known to be gone."""
        return True

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqReceiver(StepReceiver):
    """Messages are frames on the PULL socket; their arrays view the frame, which lives as
    long as they are referenced (releasing costs nothing). ZeroMQ cannot tell whether the
    sender lives: :meth:`peer_alive` stays True and bin/serve's process watch notices."""

    def recv(self, timeout_s: float | None = None) -> Any | None:
        if timeout_s is not None and not self._sock.poll(int(timeout_s * 1000)):
            return None
        return codec.decode(self._sock.recv(copy=False).buffer)

    def pollable(self) -> zmq.Socket:
        return self._sock

    def arm(self) -> bool:
        return self.ready()

    def wait(self, timeout_s: float | None = None) -> bool:
        return bool(self._sock.poll(None if timeout_s is None else int(timeout_s * 1000)))

    def ready(self) -> bool:
        return bool(self._sock.poll(0))


class RemoteReceiver(ZmqReceiver):
    """A reader on another node: frames on a TCP PULL socket, as :class:`ZmqReceiver`, which
    also knows when the sender's node is gone. The socket's monitor reports the connection's
    loss (the sender's process died and its kernel closed it; or, with the whole host gone
    silent, ZeroMQ's heartbeats, every ``HEARTBEAT_S``, went unanswered for
    ``HEARTBEAT_TIMEOUT_S``): every wait then raises PeerGone once nothing is left to read.
    Before the first connection (the sender binds once the ranks are up) nothing is lost.
    With the channel's ``remote_key`` the socket is a CurveZMQ client holding the cluster key;
    a handshake node 0 refuses raises PeerGone saying so.
    """

    HEARTBEAT_S = 1.0
    HEARTBEAT_TIMEOUT_S = 10.0

    def __init__(self, ctx: zmq.Context, spec: ChannelSpec, *, bind: bool, reader: int = 0) -> None:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.HEARTBEAT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.HEARTBEAT_TIMEOUT_S * 1000))
        if spec.remote_key is not None:
            transport.ClusterKey.load(spec.remote_key).join(sock)
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | transport.HANDSHAKE_FAILED
        self._monitor = sock.get_monitor_socket(events)
        self._address = spec.reader_address(reader)
        self._connected = self._lost = False
        self._refused = ""  # why node 0 refused the handshake (a key that is not its own)
        self._sock = transport.socket(ctx, zmq.PULL, self._address, bind=False, sock=sock)

    def _check_peer(self) -> None:
        """Read the monitor's events; raise PeerGone once the connection is lost (or refused)
        and no message is left."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            self._connected |= event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            self._lost |= event == zmq.EVENT_DISCONNECTED and self._connected
            if event & transport.HANDSHAKE_FAILED:
                self._lost, self._refused = True, transport.handshake_refusal(self._address)
        if self._lost and not self._sock.poll(0):
            raise PeerGone(self._refused or f"lost the connection to node 0 (the scheduler's plans at {self._address})")

    def recv(self, timeout_s: float | None = None) -> Any | None:
        if not self.wait(timeout_s):
            return None
        return codec.decode(self._sock.recv(copy=False).buffer)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits on the socket and its monitor together, so a lost node ends the wait."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check_peer()
            if self._sock.poll(0):
                return True
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                return False
            poller.poll(None if left is None else int(left * 1000) + 1)

    def ready(self) -> bool:
        self._check_peer()
        return bool(self._sock.poll(0))

    def peer_alive(self) -> bool:
        return not self._lost

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        super().close()


class RingReceiver(StepReceiver):
    """Messages are read in place in the ring's slots; a diverted one (its marker in the
    ring) is taken from the PULL socket. A message's slot stays reserved until the next
    request for a message (or :meth:`release`)."""

    def __init__(self, ctx: zmq.Context, spec: ChannelSpec, *, bind: bool, reader: int = 0) -> None:
        super().__init__(ctx, spec, bind=bind, reader=reader)
        try:
            self._ring = RingReader(spec.ring_path, reader, spin_us=spec.spin_us)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._holding = False  # a message's slot is reserved until the next recv
        self._spin_s = spec.spin_us / 1e6

    def recv(self, timeout_s: float | None = None) -> Any | None:
        self.release()
        ring = self._ring
        try:
            item = ring.view(timeout_s)
        except (RingClosed, WriterDied) as exc:
            raise PeerGone(str(exc)) from None
        if item is None:
            return None
        if isinstance(item, Diverted):
            ring.advance()
            if not self._sock.poll(DIVERTED_TIMEOUT_MS):
                raise codec.DecodeError(f"diverted message {item.index} never arrived on {self._sock.LAST_ENDPOINT!r}")
            return codec.decode(self._sock.recv(copy=False).buffer)
        self._holding = True
        try:
            return codec.decode(item)
        except codec.DecodeError:
            self.release()
            raise

    def release(self) -> None:
        if self._holding:
            self._holding = False
            self._ring.advance()

    def pollable(self) -> int:
        return self._ring.fileno()

    def arm(self) -> bool:
        self.release()
        return self._ring.arm()

    def disarm(self) -> None:
        self._ring.disarm()

    def wait(self, timeout_s: float | None = None) -> bool:
        self.release()
        try:
            return self._ring.view(timeout_s) is not None
        except (RingClosed, WriterDied) as exc:
            raise PeerGone(str(exc)) from None

    def spin(self) -> bool:
        return self.wait(self._spin_s)

    def ready(self) -> bool:
        self.release()
        return self._ring.ready()

    def peer_alive(self) -> bool:
        return self._ring.writer_alive()

    def close(self) -> None:
        self.release()
        self._ring.close()
        super().close()
