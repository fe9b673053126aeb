"""The node link: one ZeroMQ connection between node 0's bin/serve and each other node's, for
joining and for noticing a node that is gone while nothing else would.

Why a link of its own: the ranks notice a dead peer only in their next collective (within
``--distributed-timeout``), and node 0's scheduler cannot tell whether a remote rank still
reads its plan socket. An idle server would keep a dead node unnoticed, and take requests it
can only fail after that timeout. The supervisors, which watch every process of their node,
hold this link instead (node 0 binds it at ``--dist-init-addr`` PORT + 1,
:func:`node_link_address`):

Joining
    Node ``R > 0`` connects and sends :class:`NodeHello` with :func:`join_settings` *before*
    it starts its ranks; node 0 compares them with its own and answers :class:`NodeVerdict`.
    A node that differs (conveyor version or commit, torch, the model's config, the flags that
    shape plans) is refused and both nodes fail to start, each naming the differences, rather
    than joining a process group whose ranks disagree in ways no collective reports.
Liveness
    Both ends send ZMTP heartbeats every :data:`HEARTBEAT_S`; each end's socket monitor reports
    the connection lost when the peer's process dies (its kernel closes the connection: seen
    at once) or its host goes silent (no heartbeat for :func:`silence_bound`, at most
    :data:`MAX_SILENCE_S` and never more than ``--distributed-timeout``). Node 0 then stops,
    answering every request in flight with an error that names the node; the other nodes stop
    when node 0 is lost or says it stops (:class:`Shutdown` on the link).
Authentication
    With ``--cluster-key`` the link is CurveZMQ, as the plan sockets are
    (:class:`conveyor.ipc.transport.ClusterKey`): a node without the key fails at the
    handshake, before it has sent anything or started a rank, with an error that says so.

Invariant: node ``R > 0`` starts no rank before node 0 admitted it, so a refused node never
reaches the process group.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import zmq
from zmq.utils.monitor import recv_monitor_message

from conveyor.ipc import codec
from conveyor.ipc.messages import PROTOCOL_VERSION, NodeHello, NodeVerdict, Shutdown
from conveyor.ipc.transport import HANDSHAKE_FAILED, ClusterKey, handshake_refusal
from conveyor.runtime.config import ServerConfig, dist_init_host_port
from conveyor.runtime.model_source import StartupError
from conveyor.version import __version__

HEARTBEAT_S = 1.0
MAX_SILENCE_S = 10.0
LINGER_MS = 1000  # a stopping node 0's Shutdown to the others gets this long to leave
SIGNAL_REASON = "server shutting down"  # what node 0 stops with on SIGINT/SIGTERM (Server.supervise)


def node_link_address(dist_init_addr: str) -> str:
    """Node 0's end of the link: ``tcp://HOST:PORT+1`` of ``--dist-init-addr`` HOST:PORT."""
    host, port = dist_init_host_port(dist_init_addr)
    return f"tcp://{host}:{port + 1}"


def silence_bound(distributed_timeout_s: float) -> float:
    """Seconds without a heartbeat after which a node counts as gone."""
    return min(MAX_SILENCE_S, distributed_timeout_s)


def join_settings(config: ServerConfig) -> dict[str, str]:
    """What every node must share, by a name an operator recognises: the code (a commit mismatch
    can change a message's fields without a version bump), torch (the process group's wire
    format), the model's config.json and the flags that shape plans or the group."""
    worker, runner = config.worker, config.worker.runner
    config_json = os.path.join(config.model_dir, "config.json")
    with open(config_json, "rb") as f:
        model = hashlib.sha256(f.read()).hexdigest()[:16]
    return {
        "conveyor version": __version__,
        "conveyor commit": _source_commit(),
        "message protocol": str(PROTOCOL_VERSION),
        "torch version": _installed_version("torch"),
        "model config.json (sha256)": model,
        "--tensor-parallel-size": str(worker.tensor_parallel_size),
        "--expert-parallel": str(worker.expert_parallel),
        "--nnodes": str(config.nnodes),
        "--dtype": str(runner.dtype),
        "--quantization": str(runner.quantization),
        "--block-size": str(runner.block_size),
        "--max-num-seqs": str(runner.max_num_seqs),
        "--max-loras": str(runner.max_loras),
        "--max-lora-rank": str(runner.max_lora_rank),
        "--lora-modules (names)": ",".join(sorted(name for name, _ in runner.lora_modules)),
    }


def differences(node_rank: int, theirs: dict[str, str], ours: dict[str, str]) -> str:
    """The settings in which node ``node_rank`` differs from node 0, as one line ("" if none)."""
    names = sorted(set(theirs) | set(ours))
    return "; ".join(
        f"{name}: node {node_rank} has {theirs.get(name, '(none)')!r}, node 0 {ours.get(name, '(none)')!r}"
        for name in names
        if theirs.get(name) != ours.get(name)
    )


def _source_commit() -> str:
    """The git commit conveyor's source is checked out at ("" when it is not a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _installed_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


@dataclass(frozen=True)
class NodeStop:
    """Why this node must stop: ``clean`` when node 0 stopped on a signal (exit 0), not on a fault."""

    reason: str
    clean: bool = False


class _Link:
    """One end: the socket with heartbeats, its monitor, and CurveZMQ when a key is given."""

    def __init__(self, ctx: zmq.Context, kind: int, address: str, key: ClusterKey | None, silence_s: float) -> None:
        self.address = address
        self.silence_s = silence_s
        sock = self.sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(silence_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(silence_s * 1000))
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
        self.monitor = sock.get_monitor_socket(events)
        self.authenticator = None
        if key is not None and kind == zmq.ROUTER:
            self.authenticator = key.serve(ctx, [sock])
        elif key is not None:
            key.join(sock)

    def events(self) -> list[tuple[int, int]]:
        """The monitor's (event, value) pairs since the last call."""
        found = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            found.append((int(event["event"]), int(event["value"])))
        return found

    def messages(self) -> list[tuple[list[zmq.Frame], object]]:
        """The frames and decoded message of each message waiting (malformed ones skipped)."""
        found = []
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            try:
                found.append((frames, codec.decode(frames[-1].buffer)))
            except codec.DecodeError as exc:
                print(f"conveyor: dropping a malformed node-link message: {exc}", file=sys.stderr, flush=True)
        return found

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()
        if self.authenticator is not None:
            self.authenticator.stop()


class NodeLinkHub(_Link):
    """Node 0's end: admits nodes ``1 .. nnodes - 1`` whose settings equal ``settings`` and
    watches their connections."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        key: ClusterKey | None,
        nnodes: int,
        settings: dict[str, str],
        silence_s: float,
    ) -> None:
        super().__init__(ctx, zmq.ROUTER, address, key, silence_s)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.nnodes = nnodes
        self.settings = settings
        self.joined: dict[int, bytes] = {}  # node rank -> routing id
        self._node_of_fd: dict[int, int] = {}  # a joined node's connection (its file descriptor) -> node rank
        self._lost: int | None = None  # the first joined node whose connection was lost
        self._refusals_seen = False
        try:
            self.sock.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise StartupError(f"cannot bind the node link at {address}: {exc}") from None

    def admit(self, starting: bool = True) -> None:
        """Answer every hello waiting (never blocks). While ``starting``, a node whose settings
        differ stops this one too (StartupError naming them): the server cannot start without it."""
        self._take_events()
        for frames, msg in self.messages():
            if not isinstance(msg, NodeHello):
                continue
            rank, mismatch = msg.node_rank, ""
            if not starting:
                refusal = "the server is running with all its nodes"
            elif not 0 < rank < self.nnodes:
                refusal = f"node rank {rank} outside 1..{self.nnodes - 1}"
            elif rank in self.joined:
                refusal = f"node {rank} has joined already"
            else:
                refusal = mismatch = differences(rank, msg.settings, self.settings)
            self._send(frames[0].bytes, NodeVerdict(refusal))
            if mismatch:
                raise StartupError(f"node {rank} cannot join: {mismatch}")
            if not refusal:
                self.joined[rank] = frames[0].bytes
                self._node_of_fd[frames[-1].get(zmq.SRCFD)] = rank
                print(
                    f"conveyor: node {rank} joined from {frames[-1].get('Peer-Address')}", file=sys.stderr, flush=True
                )

    def watch(self, starting: bool = False) -> NodeStop | None:
        """A joined node whose connection was lost (None while all are there); hellos are
        answered (:meth:`admit`), refused once the server has started."""
        self.admit(starting)
        if self._lost is None:
            return None
        return NodeStop(
            f"lost contact with node {self._lost} (its bin/serve exited, or its host was silent for "
            f"{self.silence_s:g} s); with --nnodes {self.nnodes} every node is needed"
        )

    def _take_events(self) -> None:
        """Note a joined node's lost connection, and report the first refused handshake."""
        for event, value in self.events():
            if event == zmq.EVENT_DISCONNECTED and value in self._node_of_fd and self._lost is None:
                self._lost = self._node_of_fd[value]
            if event & HANDSHAKE_FAILED and not self._refusals_seen:
                self._refusals_seen = True
                print(
                    f"conveyor: refused a connection to the node link at {self.address}: its cluster key is not "
                    "this node's --cluster-key (further refusals are not reported)",
                    file=sys.stderr,
                    flush=True,
                )

    def stop(self, reason: str) -> None:
        """Tell every joined node that this server stops, and why."""
        for identity in self.joined.values():
            self._send(identity, Shutdown(reason))

    def _send(self, identity: bytes, msg: object) -> None:
        try:
            self.sock.send_multipart([identity, codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # that node is gone already: its loss is reported on its own


class NodeLinkMember(_Link):
    """Node ``node_rank``'s end: joins node 0 (:meth:`join`) and watches the connection."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        key: ClusterKey | None,
        node_rank: int,
        settings: dict[str, str],
        silence_s: float,
    ) -> None:
        super().__init__(ctx, zmq.DEALER, address, key, silence_s)
        self.sock.connect(address)
        self.sock.send(codec.encode(NodeHello(node_rank, settings)))

    def join(self, timeout_s: float, interrupted: Callable[[], bool]) -> None:
        """Wait for node 0's verdict; StartupError if it refuses this node (its key, its
        settings), does not answer within ``timeout_s``, or ``interrupted()``."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            for event, _ in self.events():
                if event & HANDSHAKE_FAILED:
                    raise StartupError(handshake_refusal(self.address))
            for _, msg in self.messages():
                if isinstance(msg, NodeVerdict):
                    if msg.refusal:
                        raise StartupError(f"node 0 at {self.address} refused this node: {msg.refusal}")
                    return
            if interrupted():
                raise StartupError("interrupted during startup")
            if time.monotonic() > deadline:
                raise StartupError(
                    f"node 0 did not answer at {self.address} within {timeout_s:g} s (not started, or unreachable?)"
                )
            poller.poll(200)

    def watch(self, starting: bool = False) -> NodeStop | None:
        """Node 0 lost or stopping (None while it is there)."""
        for _, msg in self.messages():
            if isinstance(msg, Shutdown):
                return NodeStop(f"node 0 stopped ({msg.reason})", clean=msg.reason == SIGNAL_REASON)
        for event, _ in self.events():
            if event == zmq.EVENT_DISCONNECTED:
                return NodeStop(
                    f"lost contact with node 0 at {self.address} (its bin/serve exited, or its host was silent "
                    f"for {self.silence_s:g} s)"
                )
        return None
