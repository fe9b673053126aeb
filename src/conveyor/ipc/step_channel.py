"""The scheduler <-> worker hop: plans one way, results the other, one message per step.

Each direction is a :class:`StepSender` in one process and a
:class:`~conveyor.ipc.step_receivers.StepReceiver` (in :mod:`conveyor.ipc.step_receivers`) in the
other, over one of two transports chosen by ``bin/serve --plan-transport``:

``shm`` (the default)
    A shared-memory ring (:mod:`conveyor.ipc.shm_ring`) per direction. The sender writes
    the encoded message (header and raw array parts, :func:`codec.encode_parts`) straight
    into a slot; the receiver decodes it in place, so the plan's arrays are numpy views over
    shared memory: no socket, no I/O thread, no copy on either side. The receiver wakes by
    spinning briefly, then on the ring's doorbell FIFO, which also goes into the caller's own
    poller (:meth:`~conveyor.ipc.step_receivers.StepReceiver.pollable`, ``arm``). A message larger than a
    slot (a plan carrying long prompts) travels on the direction's ZeroMQ PUSH/PULL pair
    instead, with a marker in the ring keeping its place in line, so receivers see one order.
``zmq``
    The same ZeroMQ PUSH/PULL pair carries everything (one frame per message, ``ipc://``).
    For processes on different hosts, and for comparison.

Same codec and message types either way.

Several readers (tensor parallelism: every rank runs every plan)
    A direction may have ``readers`` receivers, reader ``r`` being rank ``r``; the sender
    sends each message once and every reader gets it. The ring is one writer and N readers
    (a slot is reused once every reader has read it). ZeroMQ, the whole channel with ``zmq``
    and the diversion path with ``shm``, is one PUSH/PULL pair *per reader*
    (:meth:`ChannelSpec.reader_address`), the sender writing the same encoded frame to each:
    a single PUSH would deal messages round-robin, and PUB/SUB drops what is sent before a
    subscriber has joined or past its high-water mark, silently, where a lost plan would
    leave one rank a step behind the others. Per-reader pairs keep PUSH/PULL's guarantees
    (FIFO, nothing dropped, back-pressure) for every reader, which the diversion's pairing
    of the k-th marker with the k-th fallback message needs.

Readers on other nodes (multi-node tensor parallelism, ``bin/serve --nnodes``)
    Ranks on other hosts cannot map the ring or reach an ``ipc://`` socket. A channel may
    therefore name ``remote_address`` (``tcp://HOST:PORT``, derived from ``--dist-init-addr``):
    readers ``local_readers .. readers - 1`` are remote, each with its own PUSH/PULL pair over
    TCP (reader ``local_readers + k`` on ``PORT + k``), and the sender writes every message to
    them encoded whole, beside the ring (or the ipc sockets) that stays the local path. The
    ring has only the local readers. A remote reader is never left waiting on a dead node:
    its PULL socket's monitor reports the connection to the sender lost (the peer's kernel
    closed it, or ZeroMQ heartbeats stopped) and :class:`~conveyor.ipc.step_receivers.RemoteReceiver` raises PeerGone.

Lifetime of a received message: with ``shm`` its Int32Array fields view the ring slot,
which stays reserved until the next ``StepReceiver.recv`` (or ``release``). A
receiver therefore handles a message completely, copying anything it keeps, before it
asks for the next one. (With ``zmq`` the arrays view the ZeroMQ frame and live as long as
they are referenced; the rule costs nothing there.)

A crashed peer is never waited on forever: a ring reader checks the writer's pid while it
sleeps (:class:`PeerGone` once the writer is gone and nothing is left), and a ring writer
drops a reader whose process is gone instead of waiting for its slot. On ZeroMQ, bin/serve's
process watch is what notices (it stops every process when one dies).

The rings are created by bin/serve before it starts the processes (:func:`create_rings`)
and removed with its run directory (:func:`remove_rings`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import zmq

from conveyor.ipc import codec, shm_ring, transport
from conveyor.ipc.shm_ring import RingWriter

# Plans carry new requests' whole token lists: a slot holds about 60k tokens of them;
# a bigger plan is diverted to ZeroMQ. Results are small (one token per request).
PLAN_SLOT_BYTES = 256 * 1024
RESULT_SLOT_BYTES = 64 * 1024
NUM_SLOTS = 8
# A diverted message was sent on ZeroMQ before its marker was published: it is in flight.
DIVERTED_TIMEOUT_MS = 10_000


class PeerGone(ConnectionError):
    """The process at the other end of a ring is gone (or closed it) and nothing is left to read."""


@dataclass(frozen=True)
class ChannelSpec:
    """One direction of the hop, as both processes need to know it (it travels to ``spawn``ed
    children inside their configs).

    ``zmq_address``: the direction's PUSH/PULL pair (the whole channel with ``zmq``, the
    fallback for oversize messages with ``shm``); ``ring_path``: the ring (None with ``zmq``);
    ``readers``: how many receivers get every message (one per tensor-parallel rank), of which
    the first ``local_readers`` (None: all) are on this host and the others on other nodes,
    reached at ``remote_address`` (``tcp://HOST:PORT``, the first remote reader's port).
    """

    zmq_address: str
    ring_path: str | None = None
    slot_bytes: int = PLAN_SLOT_BYTES
    spin_us: float = shm_ring.DEFAULT_SPIN_US
    readers: int = 1
    local_readers: int | None = None
    remote_address: str | None = None
    remote_key: str | None = None  # --cluster-key: the remote readers' sockets are CurveZMQ with it

    def __post_init__(self) -> None:
        if not 1 <= self.readers <= shm_ring.MAX_READERS:
            raise ValueError(f"a step channel has 1..{shm_ring.MAX_READERS} readers, got {self.readers}")
        if not 1 <= self.num_local_readers <= self.readers:
            raise ValueError(f"a step channel has 1..{self.readers} local readers, got {self.local_readers}")
        if self.num_local_readers > 1 and not self.zmq_address.startswith("ipc://"):
            raise ValueError(
                f"several readers need an ipc:// address (one socket file per reader), got {self.zmq_address}"
            )
        if (self.num_local_readers < self.readers) != (self.remote_address is not None):
            raise ValueError("a step channel has a remote_address exactly when some of its readers are remote")
        if self.remote_address is not None:
            _tcp_host_port(self.remote_address)

    @property
    def num_local_readers(self) -> int:
        return self.readers if self.local_readers is None else self.local_readers

    def is_remote(self, reader: int) -> bool:
        """Whether reader ``reader`` is on another node (reached over TCP, not the ring)."""
        return reader >= self.num_local_readers

    def reader_address(self, reader: int) -> str:
        """The PUSH/PULL pair of reader ``reader``: ``zmq_address`` for reader 0, a sibling
        socket file for the other local ones, ``remote_address``'s port plus the remote
        reader's index for a remote one."""
        if not 0 <= reader < self.readers:
            raise ValueError(f"reader {reader} out of range: the channel has {self.readers}")
        if self.is_remote(reader):
            host, port = _tcp_host_port(self.remote_address)
            return f"tcp://{host}:{port + reader - self.num_local_readers}"
        return self.zmq_address if reader == 0 else f"{self.zmq_address}-{reader}"


def _tcp_host_port(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` split (ValueError for anything else)."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"expected tcp://HOST:PORT, got {address!r}")
    return host, int(port)


@dataclass(frozen=True)
class StepChannels:
    plans: ChannelSpec  # scheduler -> worker: StepPlan, ProfileQuery, Shutdown
    results: ChannelSpec  # worker -> scheduler: StepResult, ProfileReport

    @classmethod
    def for_server(
        cls,
        run_dir: str,
        plans_address: str,
        results_address: str,
        *,
        shm: bool,
        plan_readers: int = 1,
        local_plan_readers: int | None = None,
        remote_plans_address: str | None = None,
        remote_plans_key: str | None = None,
    ) -> StepChannels:
        """Both directions on their ZeroMQ sockets, with a ring each in ``run_dir`` when ``shm``.
        Plans go to ``plan_readers`` workers (the tensor-parallel ranks), the first
        ``local_plan_readers`` on this host and the others at ``remote_plans_address``
        (CurveZMQ with the key pair file ``remote_plans_key``, if any); results come from one
        (rank 0, always local)."""
        return cls(
            ChannelSpec(
                plans_address,
                shm_ring.ring_path(run_dir, "plans.ring") if shm else None,
                PLAN_SLOT_BYTES,
                readers=plan_readers,
                local_readers=local_plan_readers,
                remote_address=remote_plans_address,
                remote_key=remote_plans_key,
            ),
            ChannelSpec(
                results_address, shm_ring.ring_path(run_dir, "results.ring") if shm else None, RESULT_SLOT_BYTES
            ),
        )


def create_rings(channels: StepChannels) -> None:
    """Create the rings of ``channels`` (nothing for ZeroMQ); raises OSError with the reason."""
    made: list[str] = []
    try:
        for spec in (channels.plans, channels.results):
            if spec.ring_path is not None:
                shm_ring.create_ring(
                    spec.ring_path, slot_bytes=spec.slot_bytes, num_slots=NUM_SLOTS, num_readers=spec.num_local_readers
                )
                made.append(spec.ring_path)
    except BaseException:
        for path in made:
            shm_ring.unlink_ring(path)
        raise


def remove_rings(channels: StepChannels) -> None:
    for spec in (channels.plans, channels.results):
        if spec.ring_path is not None:
            shm_ring.unlink_ring(spec.ring_path)


class StepSender:
    """The writing end of one direction, to every reader. ``bind``: this end binds the ZeroMQ
    sockets (one per reader). Remote readers (another node's ranks) get every message on
    their TCP socket, encoded whole, whatever the local transport.

    ``StepSender(ctx, spec, bind=...)`` builds the transport ``spec`` names, once: a
    :class:`RingSender` when it has a ring, else a :class:`ZmqSender`.
    """

    def __new__(cls, ctx: zmq.Context, spec: ChannelSpec, *, bind: bool) -> StepSender:
        if cls is StepSender:
            cls = ZmqSender if spec.ring_path is None else RingSender
        return super().__new__(cls)

    def __init__(self, ctx: zmq.Context, spec: ChannelSpec, *, bind: bool) -> None:
        self._socks: list[zmq.Socket] = []  # the local readers'
        self._remote: list[zmq.Socket] = []  # the other nodes' readers'
        self._authenticator = None
        try:
            for reader in range(spec.num_local_readers):
                self._socks.append(transport.socket(ctx, zmq.PUSH, spec.reader_address(reader), bind=bind))
            remote = [ctx.socket(zmq.PUSH) for _ in range(spec.num_local_readers, spec.readers)]
            self._remote = remote
            if remote and spec.remote_key is not None:
                self._authenticator = transport.ClusterKey.load(spec.remote_key).serve(ctx, remote)
            for reader, sock in enumerate(remote, spec.num_local_readers):
                transport.socket(ctx, zmq.PUSH, spec.reader_address(reader), bind=bind, sock=sock)
        except BaseException:
            self.close()
            raise

    def send(self, msg: Any) -> None:
        """Encode and send ``msg`` (to every reader)."""
        self._send_local(msg)
        if self._remote:
            payload = codec.encode(msg)
            for sock in self._remote:
                sock.send(payload, copy=False)

    def _send_local(self, msg: Any) -> None:
        raise NotImplementedError

    def _send_to_every_reader(self, payload: Any) -> None:
        for sock in self._socks:
            sock.send(payload, copy=False)

    def close(self) -> None:
        for sock in self._socks + self._remote:
            sock.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


class ZmqSender(StepSender):
    """Every message is one frame on each reader's PUSH socket (encoded once)."""

    def _send_local(self, msg: Any) -> None:
        self._send_to_every_reader(codec.encode(msg))


class RingSender(StepSender):
    """Messages go into the ring's slots; one larger than a slot goes on every reader's PUSH
    socket, with a marker keeping its place in the ring."""

    def __init__(self, ctx: zmq.Context, spec: ChannelSpec, *, bind: bool) -> None:
        super().__init__(ctx, spec, bind=bind)
        try:
            self._ring = RingWriter(spec.ring_path, spin_us=spec.spin_us)
        except BaseException:
            super().close()
            raise

    def _send_local(self, msg: Any) -> None:
        """Waits for a free slot as long as a reader that holds it lives."""
        self._ring.send(codec.encode_parts(msg), divert=self._divert)

    def _divert(self, payload: Any) -> None:
        # One copy out of the caller's buffers (a part may view the message's arrays), then
        # the same bytes to every reader.
        self._send_to_every_reader(bytes(payload))

    def close(self) -> None:
        self._ring.close()  # the readers drain what is left, then see the ring closed
        super().close()


def ring_files(channels: StepChannels) -> list[str]:
    """The files the rings of ``channels`` occupy (for tests and clean-up checks)."""
    paths = []
    for spec in (channels.plans, channels.results):
        if spec.ring_path is not None:
            paths += [spec.ring_path, *(shm_ring.bell_path(spec.ring_path, r) for r in range(spec.num_local_readers))]
    return [p for p in paths if os.path.exists(p)]
