"""Python clients for a running Conveyor server (``conveyor.client``).

``Client`` is synchronous and ``AsyncClient`` is for asyncio; both speak the
msgpack protocol of docs/protocol.md over one ZeroMQ DEALER socket, so many
requests can be in flight on one client at once. Keyword arguments of
``generate``/``stream`` are the request fields of the protocol (max_tokens,
temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, priority).
Sending ``request_id`` of a finished request continues it (docs/protocol.md).

Failure is always an exception, never a hang:

- no server answers at the address: :class:`NoServerError` within ``connect_timeout``
  seconds. A ZeroMQ connect never fails by itself (it retries in the background), so a send
  made while the client is not connected waits at most that long for the ZeroMQ handshake
  with the server, which the server's I/O thread completes at once however busy its loop is.
- the server refuses the client's keys (``--auth-keys``: a wrong or missing key pair, or a
  wrong ``server_key``): :class:`AuthenticationError`, as soon as the handshake fails.
- the connection is lost (the server was killed, its host or the network went away):
  every request in flight fails with :class:`ServerGoneError`, at once when the peer's
  socket closes, else within ``liveness_timeout`` seconds, after which ZMTP heartbeats (a
  PING each second, answered by the server's I/O thread) count the connection dead. The
  server aborts a lost connection's requests, so none of them can be resumed; the next send
  waits for a new connection as above.
- the server is connected but says nothing for ``timeout`` seconds: :class:`TimeoutError`;
  the request is aborted on the way out. This is about a reply, so a slow first token (a
  long prompt's prefill) is waited for up to ``timeout``.

A socket monitor reports the handshakes and disconnects; it wakes the client only when the
connection changes. ``identity`` names the connection at the server (its ZeroMQ routing
id; default: 16 random bytes) and, without authentication, scopes the client's request ids
there: a client that reconnects with the same identity finds its requests and sessions
(continuations) again; two connections with one identity take it from each other.
``client_key``/``server_key`` (files written by bin/keygen) make the connection a
CurveZMQ one; then the key scopes the request ids. A message over the protocol's size limit
is refused here (ValueError) rather than sent for the server to drop the connection.
A zmq socket is not thread-safe: use one ``Client`` per thread.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from conveyor.ipc import transport
from conveyor.protocol import messages as cp

DEFAULT_ADDRESS = "tcp://127.0.0.1:7700"
DEFAULT_TIMEOUT_S = 300.0
# How long a send waits for a connection to the server (a local one completes in about a
# millisecond; a server still starting has this long to bind its socket).
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# How long a connection that answers no heartbeat counts as alive (a closed one is seen at once).
DEFAULT_LIVENESS_TIMEOUT_S = 5.0
HEARTBEAT_IVL_MS = 1000  # at most; half the liveness timeout when that is shorter


class ServerError(RuntimeError):
    """The server answered with a protocol-level ``error`` map; ``code`` is its
    machine-readable code (see docs/protocol.md)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class NoServerError(ConnectionError):
    """Nothing answered at the client's address: no server is listening there (or it died)."""

    def __init__(self, address: str, connect_timeout: float) -> None:
        super().__init__(f"no server at {address} (no connection within {connect_timeout:g} s)")
        self.address = address


class ServerGoneError(ConnectionError):
    """The connection to the server was lost with this request in flight: its process died
    or stopped answering heartbeats. The server has dropped the request; send it again to
    retry (a new connection is made)."""

    def __init__(self, address: str, what: str) -> None:
        super().__init__(f"lost the connection to the server at {address}; {what} failed")
        self.address = address


class AuthenticationError(ConnectionError):
    """The server refused this client's CurveZMQ handshake: its key pair is not allowed there,
    it has none while the server requires one (or the reverse), or ``server_key`` is not the
    server's."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"the server at {address} refused the connection: {reason}")
        self.address = address


# The handshake failures a monitor reports, as the reason an AuthenticationError gives.
_MISMATCH = (
    "the security handshake failed: the server requires a key pair and this client has none "
    "(client_key, server_key), or the reverse, or server_key is not the server's public key"
)
_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "this client's key is not allowed there (bin/keygen DIR --client NAME makes one)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: _MISMATCH,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: _MISMATCH,
}
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
for _event in _REFUSALS:
    _MONITOR_EVENTS |= _event
# Replies to a lost connection's requests are this internal message (never on the wire).
_CONNECTION_LOST = "__connection_lost__"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV the server reused (prefix cache, continuation)


@dataclass
class CompletionResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timing: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Delta:
    """One piece of a stream. The last one has ``finish_reason`` set and carries ``result``."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    result: CompletionResult | None = None


def _result(msg: dict[str, Any]) -> CompletionResult:
    usage = msg.get("usage") or {}
    return CompletionResult(
        request_id=msg["request_id"],
        text=msg.get("text", ""),
        token_ids=list(msg.get("token_ids", [])),
        finish_reason=msg["finish_reason"],
        usage=Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), usage.get("cached_tokens", 0)),
        timing=msg.get("timing") or {},
        error=msg.get("error"),
    )


def generate_message(
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    token_ids: list[int] | None,
    request_id: str | None,
    stream: bool,
    fields: dict[str, Any],
) -> dict[str, Any]:
    """The ``generate`` map of the client protocol (docs/protocol.md) for these inputs and
    request fields; a uuid names the request when ``request_id`` is None. For callers that
    drive a socket of their own (tests, bin/soak's disconnecting clients)."""
    msg: dict[str, Any] = {"type": cp.GENERATE, "v": cp.CLIENT_PROTOCOL_VERSION, "stream": stream}
    msg["request_id"] = request_id or uuid.uuid4().hex
    for key, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids)):
        if value is not None:
            msg[key] = value
    unknown = set(fields) - set(cp.OPTION_FIELDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    msg.update({k: v for k, v in fields.items() if v is not None})
    return msg


def _to_delta(msg: dict[str, Any]) -> Delta:
    """Turn a server message of a streamed request into a Delta."""
    if msg["type"] == cp.DELTA:
        return Delta(msg["request_id"], msg.get("text", ""), list(msg.get("token_ids", [])))
    result = _result(msg)
    return Delta(result.request_id, "", [], finish_reason=result.finish_reason, result=result)


# Replies the asyncio reader takes per wake-up without awaiting (see AsyncClient._read_loop).
_DRAIN_MAX = 256

# Replies that answer a command rather than a request are routed by their type.
_CONTROL_KEYS = {cp.STATS_REPLY: "__stats__", cp.PROFILE_REPLY: "__profile__", cp.METRICS_REPLY: "__metrics__"}


def _reply_key(reply: dict[str, Any]) -> str | None:
    return _CONTROL_KEYS.get(reply.get("type")) or reply.get("request_id")


def _awaited_key(msg: dict[str, Any], awaiting: set[str], *released: set[str]) -> str | None:
    """The key of the replies a message sent asks for (None: an abort asks for none).

    A generate under an id this client still awaits is refused here (ValueError): the
    server would refuse it with an ``error`` under the same id, which could not be told
    apart from the running request's own replies on this side. An id in one of the
    ``released`` sets (aborted by the caller, or given up on: the server frees it in order,
    before it reads this message) is free at once."""
    if msg["type"] == cp.GENERATE:
        rid = msg["request_id"]
        if rid in awaiting and not any(rid in ids for ids in released):
            raise ValueError(f"request id {msg['request_id']!r} is already in flight on this client")
        return msg["request_id"]
    return _CONTROL_KEYS.get(msg["type"])


def _profile_message(window_s: float, trace: bool, series: list[str] | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": cp.PROFILE, "v": cp.CLIENT_PROTOCOL_VERSION, "window_s": window_s, "trace": trace}
    if series:
        msg["series"] = list(series)
    return msg


def _stats_message(iterations: bool) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": cp.STATS, "v": cp.CLIENT_PROTOCOL_VERSION}
    if iterations:
        msg["iterations"] = True
    return msg


def _metrics_message() -> dict[str, Any]:
    return {"type": cp.METRICS, "v": cp.CLIENT_PROTOCOL_VERSION}


def _abort_message(request_id: str) -> dict[str, Any]:
    return {"type": cp.ABORT, "v": cp.CLIENT_PROTOCOL_VERSION, "request_id": request_id}


def _check_error(msg: dict[str, Any]) -> None:
    if msg.get("type") == cp.ERROR:
        raise ServerError(msg.get("message", "unknown server error"), msg.get("code"))
    if msg.get("type") == _CONNECTION_LOST:
        raise ServerGoneError(msg["address"], msg["what"])


def _pack_request(msg: dict[str, Any]) -> bytes:
    """``msg`` on the wire; ValueError when it is over the protocol's limit (the server would
    drop the connection, with every request on it, rather than read it)."""
    data = cp.pack(msg)
    if len(data) > cp.MAX_CLIENT_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds the protocol's limit of {cp.MAX_CLIENT_MESSAGE_BYTES}")
    return data


def _connect(
    ctx: zmq.Context,
    address: str,
    identity: bytes | None,
    liveness_timeout: float | None,
    client_key: str | None,
    server_key: str | None,
) -> tuple[zmq.Socket, zmq.Socket]:
    """The DEALER socket of a client, connected to ``address``, and its monitor (handshakes,
    refusals, disconnects). The monitor starts before the connect, so no event is missed.
    Replies are never left waiting in libzmq's queue at a limit (RCVHWM 0): a client that
    is slow to read must not stop answering the server's heartbeats. Not IMMEDIATE: with it,
    libzmq drops the replies received but not yet read when the connection closes, and the
    error finals a server sends to every request as it shuts down would be lost with them."""
    if (client_key is None) != (server_key is None):
        raise ValueError("client_key and server_key go together (both files come from bin/keygen)")
    if identity is not None and not (0 < len(identity) <= 255 and identity[0] != 0):
        raise ValueError("identity must be 1 to 255 bytes, the first not zero (ZeroMQ reserves those)")
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity or uuid.uuid4().bytes)
        sock.setsockopt(zmq.RCVHWM, 0)
        if liveness_timeout is not None:  # silent since a PING (within ivl) + timeout: about liveness_timeout in all
            liveness_ms = max(2, int(liveness_timeout * 1000))
            ivl_ms = min(HEARTBEAT_IVL_MS, liveness_ms // 2)
            sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, liveness_ms - ivl_ms)
        if client_key is not None:
            transport.client_curve_keys(sock, client_key, server_key)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
    except BaseException:
        sock.close(linger=0)
        raise
    sock.connect(address)
    return sock, monitor


class _Connection:
    """What both clients hold: one DEALER socket to ``address``, its monitor, the state the
    monitor's events keep (whether the server is connected, and why it refused us), and the
    bookkeeping of the requests sent on the connection, which both route replies by.

    A subclass names its ZeroMQ context class (``_CONTEXT``: plain or asyncio), sets up
    where replies wait for their reader in ``_init_delivery`` and hands a routed reply
    there in ``_deliver``; everything that decides which reply goes where is here, once."""

    _CONTEXT: type[zmq.Context]

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
        liveness_timeout: float | None = DEFAULT_LIVENESS_TIMEOUT_S,
        identity: bytes | None = None,
        client_key: str | None = None,
        server_key: str | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.liveness_timeout = liveness_timeout
        self._ctx = self._CONTEXT.instance()
        self._sock, self._monitor = _connect(self._ctx, address, identity, liveness_timeout, client_key, server_key)
        self._connected = False
        self._refusal: str | None = None  # the last handshake failure, until a handshake succeeds
        self._abandoned: set[str] = set()  # ids whose final is still to come, for nobody
        self._awaiting: set[str] = set()  # keys sent on this connection whose final (or answer) is to come
        self._aborted: set[str] = set()  # ids the caller aborted whose final is still to come (free for reuse)
        self._init_delivery()

    def _init_delivery(self) -> None:
        """Set up where routed replies wait for their reader (the subclass's own state)."""
        raise NotImplementedError

    def _deliver(self, key: str | None, reply: dict[str, Any]) -> None:
        """Hand ``reply`` to whoever reads the replies of ``key`` (a request id or a command's key)."""
        raise NotImplementedError

    def _route(self, reply: dict[str, Any]) -> None:
        """Deliver ``reply`` to its request (or command), after noting that a final (or a
        command's one answer) ends its wait; a reply of an abandoned request is dropped, and
        its final frees the id."""
        key = _reply_key(reply)
        if reply.get("type") != cp.DELTA:  # its final, or a command's one answer
            self._awaiting.discard(key)
            self._aborted.discard(key)
        if key in self._abandoned:
            if reply.get("type") == cp.FINAL:
                self._abandoned.discard(key)
            return
        self._deliver(key, reply)

    def _fail_awaiting(self) -> None:
        """On the loss of the server (after the replies received before it are routed): every
        request still waiting gets the loss (ServerGoneError in its reader), and nothing is
        awaited any more, since no final will come on the lost connection."""
        for key in self._awaiting:
            self._deliver(key, self._lost(f"request {key!r}" if key not in _CONTROL_KEYS.values() else key.strip("_")))
        self._awaiting.clear()
        self._abandoned.clear()
        self._aborted.clear()

    def _mark_abandoned(self, request_id: str) -> bool:
        """Note that nobody reads ``request_id`` any more; True when its abort is to be sent.

        The server sends every request exactly one final, and all of it before anything of a
        later request of this client that reuses the id, so "drop up to its final" is exact;
        a final already routed, or a lost connection, means there is nothing left to drop."""
        if request_id not in self._awaiting:
            return False
        self._abandoned.add(request_id)
        return True

    def _on_event(self, frames: list[bytes]) -> bool:
        """Take one monitor event; True when it is the loss of a connected server."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected, self._refusal = True, None
        elif event in _REFUSALS:
            self._refusal = _REFUSALS[event]
        elif event == zmq.EVENT_DISCONNECTED and self._connected:
            self._connected = False
            return True
        return False

    def _lost(self, what: str) -> dict[str, Any]:
        return {"type": _CONNECTION_LOST, "address": self.address, "what": what}

    def _not_connected(self) -> ConnectionError:
        """The error of a send that found no server within ``connect_timeout``."""
        if self._refusal is not None:
            return AuthenticationError(self.address, self._refusal)
        return NoServerError(self.address, self.connect_timeout)

    def _close_socket(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


class Client(_Connection):
    """Synchronous client. Replies for other requests of this client are buffered, not lost."""

    _CONTEXT = zmq.Context

    def _init_delivery(self) -> None:
        self._inbox: dict[str | None, collections.deque] = collections.defaultdict(collections.deque)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _deliver(self, key: str | None, reply: dict[str, Any]) -> None:
        self._inbox[key].append(reply)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        token_ids: list[int] | None = None,
        request_id: str | None = None,
        **fields: Any,
    ) -> CompletionResult:
        msg = generate_message(prompt, messages, token_ids, request_id, False, fields)
        self._send(msg)
        try:
            while True:
                reply = self._next(msg["request_id"])
                if reply["type"] == cp.FINAL:
                    return _result(reply)
        except KeyboardInterrupt:  # nobody waits for it any more: free the server's work
            self._abandon(msg["request_id"])
            raise

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        token_ids: list[int] | None = None,
        request_id: str | None = None,
        **fields: Any,
    ) -> Iterator[Delta]:
        msg = generate_message(prompt, messages, token_ids, request_id, True, fields)
        self._send(msg)
        finished = False
        try:
            while not finished:
                delta = _to_delta(self._next(msg["request_id"]))
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:  # the caller stopped iterating early: free the server's work
                self._abandon(msg["request_id"])

    def abort(self, request_id: str) -> None:
        self._send(_abort_message(request_id))
        self._aborted.add(request_id)

    def stats(self, *, iterations: bool = False) -> dict[str, Any]:
        """The server's block pool, queues and counters (docs/protocol.md, ``stats``);
        ``iterations`` adds ``iterations``, the log of the most recent iterations (up to 256
        maps: batch, tokens, blocks and waits of each)."""
        self._send(_stats_message(iterations))
        return self._next("__stats__")

    def profile(self, window_s: float = 60.0, *, trace: bool = False, series: list[str] | None = None) -> dict[str, Any]:
        """Every process's latency profile over the last ``window_s`` s (docs/protocol.md, ``profile``).

        ``trace`` adds each process's recent spans (``conveyor.profiling.chrome_trace``
        turns the reply's ``processes`` into one Chrome/Perfetto trace); ``series`` names value
        series whose raw samples to include, e.g. ``["batch_seqs"]``.
        """
        self._send(_profile_message(window_s, trace, series))
        return self._next("__profile__")

    def metrics(self) -> dict[str, Any]:
        """The frontend's request-level metrics (docs/protocol.md, ``metrics``): ``counters``
        (``prompt_tokens``, ``generation_tokens``, ``request_success`` by finish reason) and
        ``histograms`` (name -> ``{buckets, counts, sum, count}``, seconds; ``counts`` per
        bucket, not cumulative, its last entry above every bound), all since the server
        started. :func:`conveyor.http.prometheus.exposition` renders it with :meth:`stats`."""
        self._send(_metrics_message())
        return self._next("__metrics__")

    def close(self) -> None:
        self._close_socket()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, msg: dict[str, Any]) -> None:
        data = _pack_request(msg)
        self._take_events()  # a loss or a handshake since the last look
        key = _awaited_key(msg, self._awaiting, self._abandoned, self._aborted)
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

    def _take_replies(self, limit: int | None = _DRAIN_MAX) -> None:
        """Buffer the replies already received, at most ``limit`` (None: all); an error that
        names no request raises."""
        for _ in itertools.count() if limit is None else range(limit):
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = cp.unpack_map(raw)
            _check_error(reply)
            self._route(reply)

    def _abandon(self, request_id: str) -> None:
        """Abort a request nobody will read any more; its late replies are dropped on arrival
        (see :meth:`_Connection._mark_abandoned`)."""
        self._inbox.pop(request_id, None)
        if not self._mark_abandoned(request_id):
            return
        try:
            self._sock.send(_pack_request(_abort_message(request_id)), zmq.NOBLOCK)
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
                if key not in _CONTROL_KEYS.values():
                    self._abandon(key)
                raise TimeoutError(f"no reply from {self.address} within {self.timeout} s")
        reply = self._inbox[key].popleft()
        if not self._inbox[key]:
            del self._inbox[key]
        _check_error(reply)  # a lost connection's marker
        return reply


class AsyncClient(_Connection):
    """asyncio client: one reader task routes replies to the awaiting request."""

    _CONTEXT = zmq.asyncio.Context

    def _init_delivery(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None  # reads the monitor (see _watch_loop)
        self._link_changed: asyncio.Event | None = None  # set by the watcher after each event

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        token_ids: list[int] | None = None,
        request_id: str | None = None,
        **fields: Any,
    ) -> CompletionResult:
        msg = generate_message(prompt, messages, token_ids, request_id, False, fields)
        async with self._request(msg["request_id"]) as queue:
            await self._send(msg)
            try:
                while True:
                    reply = await self._next(queue, msg["request_id"])
                    if reply["type"] == cp.FINAL:
                        return _result(reply)
            except asyncio.CancelledError:  # e.g. wait_for() gave up on it: free the server's work
                await self._abandon(msg["request_id"], queue)
                raise

    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        token_ids: list[int] | None = None,
        request_id: str | None = None,
        **fields: Any,
    ) -> AsyncIterator[Delta]:
        msg = generate_message(prompt, messages, token_ids, request_id, True, fields)
        finished = False
        async with self._request(msg["request_id"]) as queue:
            await self._send(msg)
            try:
                while True:
                    delta = _to_delta(await self._next(queue, msg["request_id"]))
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

    async def abort(self, request_id: str) -> None:
        await self._send(_abort_message(request_id))
        self._aborted.add(request_id)

    async def stats(self, *, iterations: bool = False) -> dict[str, Any]:
        """As :meth:`Client.stats`."""
        async with self._request("__stats__") as queue:
            await self._send(_stats_message(iterations))
            return await self._next(queue, None)

    async def profile(
        self, window_s: float = 60.0, *, trace: bool = False, series: list[str] | None = None
    ) -> dict[str, Any]:
        """As :meth:`Client.profile`."""
        async with self._request("__profile__") as queue:
            await self._send(_profile_message(window_s, trace, series))
            return await self._next(queue, None)

    async def metrics(self) -> dict[str, Any]:
        """As :meth:`Client.metrics`."""
        async with self._request("__metrics__") as queue:
            await self._send(_metrics_message())
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
        data = _pack_request(msg)
        if self._watcher is None or self._watcher.done():
            self._link_changed = asyncio.Event()
            self._watcher = asyncio.ensure_future(self._watch_loop())
            await asyncio.sleep(0)  # let it take the events queued so far
        if not self._connected and self.connect_timeout is not None:
            await self._await_server()
        key = _awaited_key(msg, self._awaiting, self._abandoned, self._aborted)
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
            self._route(cp.unpack_map(raw))

    async def _read_loop(self) -> None:
        # One asyncio receive per wake-up, then whatever else is queued by plain non-blocking
        # receives on a synchronous shadow of the socket: a server iteration sends a delta
        # for every stream at once, and each asyncio receive costs a future and its poller
        # bookkeeping. (The asyncio socket tries an immediate receive before it waits, so
        # messages the shadow leaves are never missed.) At most _DRAIN_MAX at a time, so a
        # flood never keeps the loop from the tasks the replies wake.
        drain = zmq.Socket.shadow(self._sock.underlying)
        try:
            while True:
                self._route(cp.unpack_map(await self._sock.recv()))
                for _ in range(_DRAIN_MAX):
                    try:
                        raw = drain.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._route(cp.unpack_map(raw))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surface a dead reader to every waiter
            for queue in self._queues.values():
                queue.put_nowait({"type": cp.ERROR, "message": f"client reader failed: {exc}"})

    def _route(self, reply: dict[str, Any]) -> None:
        """As :meth:`_Connection._route`, but an error that names no request goes to every
        queue (the synchronous client raises it from its receive instead)."""
        if reply.get("type") == cp.ERROR and reply.get("request_id") is None:
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
        _check_error(reply)
        return reply

    async def _abandon(self, request_id: str, queue: asyncio.Queue) -> None:
        """Abort a request nobody will read any more (as :meth:`Client._abandon`): the reader
        drops its replies up to its final, so a later request reusing the id never gets them."""
        while not queue.empty():
            queue.get_nowait()
        if not self._mark_abandoned(request_id):  # (no await in it: the reader cannot interleave)
            return  # its final came already, or the connection was lost: nothing more will come
        try:
            await self._sock.send(_pack_request(_abort_message(request_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the queue to a server long gone is full; the server drops a lost connection's requests itself
