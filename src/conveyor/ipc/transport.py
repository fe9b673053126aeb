"""ZeroMQ plumbing shared by the processes: addresses, sockets, typed send.

Inside one server every hop is an ``ipc://`` socket in a private run directory
(mode 0700, so other users cannot connect). Hops are PUSH/PULL pairs: each
direction has one writer and one reader, so no routing is needed and a slow
reader applies back-pressure instead of dropping messages. The scheduler <-> worker
hop goes through :mod:`conveyor.ipc.step_channel`, which uses the ``plans`` and
``results`` sockets alone (``--plan-transport zmq``) or beside its shared-memory rings.

The one socket that faces users, the frontend's ROUTER, is made by
:func:`bind_client_socket` alone, with its limits, heartbeats and (``--auth-keys``)
CurveZMQ authentication; the key directory's layout is defined here too, for bin/keygen,
bin/serve and the clients.
"""

from __future__ import annotations

import errno
import ipaddress
import os
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from conveyor.ipc import codec, run_dirs


@dataclass(frozen=True)
class ServerAddresses:
    """Endpoints of one server instance. ``client`` faces users; the rest are internal."""

    client: str
    to_scheduler: str  # frontend -> scheduler (AddRequest, AbortRequests, StatsQuery)
    to_frontend: str  # scheduler -> frontend (TokenOutputs, SchedulerStats)
    plans: str  # scheduler -> worker: the step channel's ZeroMQ side (StepPlan, ProfileQuery, Shutdown)
    results: str  # worker -> scheduler: the step channel's ZeroMQ side (StepResult, ProfileReport)
    control: str  # children -> bin/serve (ProcessReady, ProcessFailed)
    frontend_control: str  # bin/serve -> frontend (Shutdown)
    # The client socket's second endpoint, in the private run directory: the HTTP process's
    # one connection for every HTTP request, which --client-send-queue does not bound (it
    # reads on its own loop; each HTTP request is bounded there, conveyor.http.generation).
    internal_client: str = ""

    @classmethod
    def in_run_dir(cls, run_dir: str, client: str) -> ServerAddresses:
        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(run_dir, name)}"

        return cls(
            client=client,
            to_scheduler=ipc("to-scheduler"),
            to_frontend=ipc("to-frontend"),
            plans=ipc("plans"),
            results=ipc("results"),
            control=ipc("control"),
            frontend_control=ipc("frontend-control"),
            internal_client=ipc("internal-client"),
        )

    def replica(self, index: int) -> ServerAddresses:
        """Data-parallel replica ``index``'s endpoints: its own scheduler and worker hops
        (``to_scheduler``, ``to_frontend``, ``plans``, ``results``, suffixed ``.<index>``); the
        client, control and frontend-control sockets are the server's. Replica 0's are these,
        so a server of one replica has exactly the endpoints it had before replicas existed."""
        if index == 0:
            return self
        return replace(
            self,
            to_scheduler=f"{self.to_scheduler}.{index}",
            to_frontend=f"{self.to_frontend}.{index}",
            plans=f"{self.plans}.{index}",
            results=f"{self.results}.{index}",
        )


def make_run_dir() -> str:
    """A fresh private run directory, claimed by this process (:mod:`conveyor.ipc.run_dirs`,
    which first reaps those of servers killed without cleaning up)."""
    return run_dirs.make_run_dir()


class AddressInUse(OSError):
    """A listening address something else holds: bin/serve says so in one line (--port)."""


def client_address(host: str, port: int) -> str:
    """``tcp://host:port``; a host that already names a transport (``ipc://...``) is used as is."""
    if "://" in host:
        return host
    return f"tcp://{host}:{port}"


def socket(ctx: zmq.Context, kind: int, address: str, *, bind: bool, sock: zmq.Socket | None = None) -> zmq.Socket:
    """A socket that never blocks close (linger 0) and has no high-water-mark drops on PUSH;
    ``sock``: set up this one (of ``kind``, its security options already set) instead of a new one."""
    if sock is None:
        sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(codec.encode(msg), copy=False)


# ---------------------------------------------------------------- the client-facing socket

# libzmq drops a connection whose frame exceeds the protocol's message limit plus this margin
# before reading it in full (a 200 MB frame costs the server nothing). The margin lets a
# message just over the limit arrive and get a reply that names it; conveyor.client refuses to
# send one. The limit itself is the protocol's (the caller passes it: the transports sit below
# conveyor.protocol, which parses what they carry).
CLIENT_FRAME_MARGIN_BYTES = 64 * 1024
# Messages queued from one connection before libzmq stops reading it (TCP back-pressure on
# that client, nothing dropped): at most CLIENT_RCVHWM frames of the bound above held per
# connection, and far less for ordinary requests of a few hundred bytes.
CLIENT_RCVHWM = 64
# Replies queued for one connection (its libzmq pipe; the kernel's socket buffers hold more
# beyond it) before a send to it fails: bin/serve --client-send-queue, this by default. Sends
# never block the frontend's loop (NOBLOCK): with ROUTER_MANDATORY a send to a full queue
# raises EAGAIN, which means the client has stopped reading (its own receive queue and the
# socket buffers are full too; for a client that never reads those hold only tens of KB, as
# TCP grows its window only as the application reads), and the frontend drops that
# connection's requests (conveyor.frontend.sending; docs/reliability.md, "Faults"). A send to
# a client already gone raises EHOSTUNREACH instead. The bound must exceed the largest burst
# one pass sends to one client (a delta and a final per request it has in flight; at a
# shutdown, an error final for every one, waiting ones included: libzmq's I/O thread drains
# the queue only between the loop's sends) and the messages a merely slow reader lags
# behind: 100k is far above both. What it implies: about 170 bytes of frontend memory a small
# delta (~60 bytes packed), so some 17 MB per connection that stops reading, more where the
# queued messages are larger (a delta of many tokens, a final that carries a long text).
# 0: no bound (a client that stops reading is never dropped; its replies queue for as long
# as its requests run).
CLIENT_SEND_QUEUE = 100_000
# ZMTP heartbeats (handled by libzmq's I/O thread, so a busy event loop never misses one):
# a PING every CLIENT_HEARTBEAT_IVL_MS; a peer that sends nothing for
# CLIENT_HEARTBEAT_TIMEOUT_MS after one is disconnected; the TTL asks clients to drop the
# connection if they hear nothing from the server for that long. A client that stops reading
# but keeps its connection is not reliably dropped by them (docs/reliability.md): the send
# queue's bound is what drops it.
CLIENT_HEARTBEAT_IVL_MS = 1000
CLIENT_HEARTBEAT_TIMEOUT_MS = 10_000
CLIENT_HEARTBEAT_TTL_MS = 10_000
# On close, replies still queued (the error finals a shutdown or a dead process sends to
# every request in flight) go out for up to this long; a socket closed at once would drop
# them, and the clients would see the connection lost instead of each request's error.
CLIENT_LINGER_MS = 1000

# --auth-keys DIR: the server's key pair, and one public key per allowed client.
SERVER_KEY_NAME = "server"
CLIENT_KEYS_DIR = "clients"


def server_public_key_file(keys_dir: str) -> str:
    """DIR/server.key: the server's public key (every client needs it, as ``server_key``)."""
    return os.path.join(keys_dir, f"{SERVER_KEY_NAME}.key")


def server_secret_key_file(keys_dir: str) -> str:
    """DIR/server.key_secret: the server's key pair (mode 0600; only the server reads it)."""
    return os.path.join(keys_dir, f"{SERVER_KEY_NAME}.key_secret")


def client_keys_dir(keys_dir: str) -> str:
    """DIR/clients: ``NAME.key`` (public) of every allowed client; deleting one revokes it for
    new connections. bin/keygen leaves ``NAME.key_secret`` beside it, for that client."""
    return os.path.join(keys_dir, CLIENT_KEYS_DIR)


def check_auth_keys(keys_dir: str) -> None:
    """ValueError unless ``keys_dir`` holds a server key pair and a client key directory, so a
    wrong ``--auth-keys`` fails bin/serve before any process starts."""
    try:
        _, secret = zmq.auth.load_certificate(server_secret_key_file(keys_dir))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--auth-keys {keys_dir}: no server key pair ({exc}); make one with bin/keygen {keys_dir}"
        ) from None
    if secret is None:
        raise ValueError(f"--auth-keys {keys_dir}: {server_secret_key_file(keys_dir)} holds no secret key")
    if not os.path.isdir(client_keys_dir(keys_dir)):
        raise ValueError(f"--auth-keys {keys_dir}: no {CLIENT_KEYS_DIR}/ directory of allowed client keys")


class AllowedClientKeys:
    """The ZAP credentials check: a client key is allowed when DIR/clients holds it, read at
    each connection (a key added or deleted counts from the next connection on), or when it
    is the server's own public key (its own processes, e.g. the HTTP one, connect with the
    server's key pair, which only the server can read)."""

    def __init__(self, keys_dir: str) -> None:
        self._clients = client_keys_dir(keys_dir)
        self._server_public, _ = zmq.auth.load_certificate(server_public_key_file(keys_dir))

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self._server_public:
            return True
        try:
            return client_key in zmq.auth.load_certificates(self._clients)
        except (OSError, ValueError):
            return False


def is_loopback(address: str) -> bool:
    """Whether only this host can reach ``address`` (a loopback tcp:// host, or ipc://)."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    return is_loopback_host(parts.hostname or "")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an IPv4/IPv6 address) is this host's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", a hostname, an interface name: reachable from elsewhere


def bind_client_socket(
    ctx: zmq.Context,
    address: str,
    *,
    max_message_bytes: int,
    auth_keys: str | None,
    send_queue: int = CLIENT_SEND_QUEUE,
    internal: str = "",
    monitor: str | None = None,
    monitor_events: int = 0,
) -> tuple[zmq.Socket, ThreadAuthenticator | None]:
    """The frontend's ROUTER, bound to ``address``, and its authenticator (None without
    ``auth_keys``; stop it before terminating ``ctx``).

    Limits, heartbeats and ROUTER_HANDOVER (a new connection with a connected routing id takes
    it over, so a client that reconnects with its stable identity is served at once instead
    of being ignored while the old connection lingers) are set here; see the constants above.
    ``max_message_bytes`` is the protocol's bound on one client message
    (:data:`conveyor.protocol.limits.MAX_CLIENT_MESSAGE_BYTES`).
    ``send_queue`` is the send high-water mark, replies queued per connection (0: none):
    send with ``zmq.NOBLOCK``, and ``zmq.Again`` means that connection's queue is full.
    ``internal`` (an ipc address in the private run directory, or empty) is bound first with
    no such bound (libzmq takes ``SNDHWM`` per endpoint, at its bind): the HTTP process's
    connection, one for every HTTP request, is not a client that stopped reading when its
    queue is long.
    With ``auth_keys`` the socket is a CurveZMQ server: a client must know the server's public
    key and hold an allowed key pair, or its handshake is refused (a ZAP thread checks it, off
    the frontend's loop). The authenticated key, Z85 text, is every message's ``User-Id``
    property (``frame.get("User-Id")``). ``monitor`` (an inproc address) reports
    ``monitor_events`` from before the bind, so none is missed; connect its reader first
    (libzmq blocks the socket on an event until the monitor has a peer).
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, CLIENT_LINGER_MS)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client or a full queue raises instead of vanishing
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + CLIENT_FRAME_MARGIN_BYTES)
    sock.setsockopt(zmq.RCVHWM, CLIENT_RCVHWM)
    sock.setsockopt(zmq.SNDHWM, send_queue)
    sock.setsockopt(zmq.HEARTBEAT_IVL, CLIENT_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, CLIENT_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, CLIENT_HEARTBEAT_TTL_MS)
    authenticator = None
    try:
        if auth_keys is not None:
            public, secret = zmq.auth.load_certificate(server_secret_key_file(auth_keys))
            authenticator = curve_servers(ctx, [sock], public, secret, AllowedClientKeys(auth_keys))
        if monitor is not None:
            sock.monitor(monitor, monitor_events)
        if internal:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind(internal)
            sock.setsockopt(zmq.SNDHWM, send_queue)
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise AddressInUse(f"{address} is already in use: stop what listens there or pick another --port") from None
    except BaseException:
        if authenticator is not None:
            authenticator.stop()
        sock.close(linger=0)
        raise
    return sock, authenticator


def curve_servers(
    ctx: zmq.Context, socks: list[zmq.Socket], public: bytes, secret: bytes, admits: Any
) -> ThreadAuthenticator:
    """Make ``socks`` (not yet bound) CurveZMQ servers with the key pair ``public``/``secret``,
    admitting the clients ``admits.callback(domain, client_key)`` admits (pyzmq's credentials
    provider);
    returns the context's ZAP thread (stop it before terminating ``ctx``), which runs on a
    synchronous view of the context with sockets of its own."""
    authenticator = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    authenticator.start()
    authenticator.configure_curve_callback("*", admits)
    for sock in socks:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return authenticator


def curve_client(sock: zmq.Socket, public: bytes, secret: bytes, server_public: bytes) -> None:
    """Make ``sock`` (not yet connected) a CurveZMQ client with its key pair and the server's public key."""
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


def load_key_pair(path: str, what: str) -> tuple[bytes, bytes]:
    """(public, secret) of a ``.key_secret`` file bin/keygen wrote; ValueError starting with
    ``what`` when it holds no key pair."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: {exc}") from None
    if secret is None:
        raise ValueError(f"{what} holds no secret key (pass the .key_secret file)")
    return public, secret


def client_curve_keys(sock: zmq.Socket, client_key: str, server_key: str) -> None:
    """Make ``sock`` a CurveZMQ client: its key pair from ``client_key`` (a ``.key_secret``
    file bin/keygen wrote) and the server's public key from ``server_key`` (its ``server.key``).
    ValueError naming the file when one holds no usable key."""
    public, secret = load_key_pair(client_key, f"client key {client_key}")
    try:
        server_public, _ = zmq.auth.load_certificate(server_key)
    except (OSError, ValueError) as exc:
        raise ValueError(f"server key {server_key}: {exc}") from None
    curve_client(sock, public, secret, server_public)


# ---------------------------------------------------------------- the sockets between nodes

# bin/keygen DIR --cluster: the one key pair every node of a multi-node server holds.
CLUSTER_KEY_NAME = "cluster"
# CurveZMQ handshakes that failed, as a socket monitor reports them.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class ClusterKey:
    """The key pair of ``--cluster-key FILE`` (a ``cluster.key_secret`` bin/keygen wrote),
    shared by every node. Node 0's inter-node sockets are CurveZMQ servers with it, the other
    nodes' connect as clients holding it, and a ZAP check admits no other client key: a peer
    without the secret file can neither read what those sockets carry (encrypted) nor join."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, path: str) -> ClusterKey:
        """ValueError naming ``path`` when it holds no key pair (bin/keygen DIR --cluster makes one)."""
        return cls(*load_key_pair(path, f"--cluster-key {path}"))

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP check: only a client holding this pair is admitted."""
        return client_key == self.public

    def serve(self, ctx: zmq.Context, socks: list[zmq.Socket]) -> ThreadAuthenticator:
        """Make ``socks`` (not yet bound) CurveZMQ servers admitting only this key; returns the
        context's ZAP thread (stop it before terminating ``ctx``)."""
        return curve_servers(ctx, socks, self.public, self.secret, self)

    def join(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet connected) a CurveZMQ client of a node serving this key."""
        curve_client(sock, self.public, self.secret, self.public)


def handshake_refusal(address: str) -> str:
    """What a failed handshake with node 0 at ``address`` means, for the error an operator
    reads. libzmq's event does not tell the cases apart reliably (a client key node 0's ZAP
    check refuses, another server key, or CurveZMQ on one side only), so this names them all."""
    return (
        f"node 0 at {address} refused this node's cluster key: the nodes' --cluster-key files differ "
        "(or one node runs --insecure-cluster)"
    )
