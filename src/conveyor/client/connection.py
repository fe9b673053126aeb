"""What both clients share: the connection, the bookkeeping of its requests, and everything
about a reply but the I/O that reads it (:mod:`conveyor.client`'s docstring describes the
behaviour). :class:`Connection` decides which reply goes where, once; the synchronous
client (:mod:`conveyor.client.sync`) and the asyncio one (:mod:`conveyor.client.aio`) add only
the calls that send, wait and receive.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from conveyor.client.commands import (
    detokenize_message,
    lora_message,
    metrics_message,
    profile_message,
    rl_message,
    stats_message,
    tokenize_message,
)
from conveyor.client.results import Choice, CompletionResult, StreamDelta, Usage, completion_result, to_delta  # noqa: F401 (re-exported)
from conveyor.ipc import transport
from conveyor.protocol import limits, wire
from conveyor.protocol import requests as client_requests
from conveyor.protocol.rl_commands import ENGINE_STATE, PAUSE, RESUME, SLEEP, UPDATE_WEIGHTS, WAKE_UP

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
    msg: dict[str, Any] = {"type": wire.GENERATE, "v": wire.CLIENT_PROTOCOL_VERSION, "stream": stream}
    msg["request_id"] = request_id or uuid.uuid4().hex
    for key, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids)):
        if value is not None:
            msg[key] = value
    unknown = set(fields) - set(client_requests.OPTION_FIELDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    msg.update({k: v for k, v in fields.items() if v is not None})
    if isinstance(msg.get("logit_bias"), dict):  # map keys travel as strings (the protocol's rule)
        msg["logit_bias"] = {str(token): bias for token, bias in msg["logit_bias"].items()}
    return msg


def _request_message(prompt: str | None, stream: bool, request: dict[str, Any]) -> dict[str, Any]:
    """:func:`generate_message` for the keywords of ``Client.generate`` / ``stream``."""
    fields = dict(request)
    inputs = [fields.pop(name, None) for name in ("messages", "token_ids", "request_id")]
    return generate_message(prompt, *inputs, stream, fields)


# Replies the asyncio reader takes per wake-up without awaiting (see AsyncClient._read_loop).
DRAIN_MAX = 256

# Replies that answer a command rather than a request are routed by their type.
CONTROL_KEYS = {wire.STATS_REPLY: "__stats__", wire.PROFILE_REPLY: "__profile__", wire.METRICS_REPLY: "__metrics__"}


def reply_key(reply: dict[str, Any]) -> str | None:
    """Whose reply this is: a command's answer by its type; an ``error`` that names a command
    (its refusal, or a server that could not answer it) goes to that command's caller; the
    rest by request id."""
    kind = reply.get("type")
    if kind == wire.ERROR and reply.get("request_id") is None and reply.get("command") in wire.COMMANDS:
        return CONTROL_KEYS[reply["command"]]
    return CONTROL_KEYS.get(kind) or reply.get("request_id")


def unaddressed_error(reply: dict[str, Any]) -> bool:
    """An ``error`` that names neither a request nor a command: every caller's concern."""
    return reply.get("type") == wire.ERROR and reply_key(reply) is None


def awaited_key(msg: dict[str, Any], awaiting: set[str], *released: set[str]) -> str | None:
    """The key of the replies a message sent asks for (None: an abort asks for none).

    A generate under an id this client still awaits is refused here (ValueError): the
    server would refuse it with an ``error`` under the same id, which could not be told
    apart from the running request's own replies on this side. An id in one of the
    ``released`` sets (aborted by the caller, or given up on: the server frees it in order,
    before it reads this message) is free at once."""
    if msg["type"] in ID_ROUTED_TYPES:  # answered under its fresh id
        return msg["request_id"]
    if msg["type"] == wire.GENERATE:
        rid = msg["request_id"]
        if rid in awaiting and not any(rid in ids for ids in released):
            raise ValueError(f"request id {msg['request_id']!r} is already in flight on this client")
        return msg["request_id"]
    return CONTROL_KEYS.get(msg["type"])


# Commands answered under the fresh request id they carry.
ID_ROUTED_TYPES = (wire.LOAD_LORA, wire.UNLOAD_LORA, wire.TOKENIZE, wire.DETOKENIZE)


def abort_message(request_id: str) -> dict[str, Any]:
    return {"type": wire.ABORT, "v": wire.CLIENT_PROTOCOL_VERSION, "request_id": request_id}


def check_error(msg: dict[str, Any]) -> None:
    if msg.get("type") == wire.ERROR:
        raise ServerError(msg.get("message", "unknown server error"), msg.get("code"))
    if msg.get("type") == _CONNECTION_LOST:
        raise ServerGoneError(msg["address"], msg["what"])


def pack_request(msg: dict[str, Any]) -> bytes:
    """``msg`` on the wire; ValueError when it is over the protocol's limit (the server would
    drop the connection, with every request on it, rather than read it)."""
    data = wire.pack(msg)
    if len(data) > limits.MAX_CLIENT_MESSAGE_BYTES:
        raise ValueError(
            f"message of {len(data)} bytes exceeds the protocol's limit of {limits.MAX_CLIENT_MESSAGE_BYTES}"
        )
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


class Connection:
    """What both clients hold: one DEALER socket to ``address``, its monitor, the state the
    monitor's events keep (whether the server is connected, and why it refused us), and the
    bookkeeping of the requests sent on the connection, which both route replies by.

    The public calls are written here, once: each builds its message and hands it to the
    subclass's I/O, which is all a subclass adds: ``_complete`` (send a generate request,
    return its :class:`CompletionResult`), ``_stream`` (send one, yield its deltas),
    ``_abort`` and ``_command`` (send a command, return its one answer), plain functions in
    :class:`~conveyor.client.sync.Client`, coroutines and an async generator in
    :class:`~conveyor.client.aio.AsyncClient` (whose calls are then awaited, or iterated with
    ``async for``). It also names its ZeroMQ context class (``_CONTEXT``: plain or asyncio),
    sets up where replies wait for their reader in ``_init_delivery`` and hands a routed
    reply there in ``_deliver``; everything that decides which reply goes where is here, once."""

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

    def generate(self, prompt: str | None = None, **request: Any) -> Any:
        """One completion: its :class:`CompletionResult` (awaited, with :class:`AsyncClient`).

        The input is ``prompt``, or the keyword ``messages`` (a chat) or ``token_ids``; the
        keyword ``request_id`` names the request (default: a fresh uuid; a finished request's
        id continues it); the other keywords are the request fields of the protocol (module
        docstring of :mod:`conveyor.client`)."""
        return self._complete(_request_message(prompt, False, request))

    def embed(self, prompt: str | None = None, *, pooling: str = "last", **request: Any) -> Any:
        """An embedding of ``prompt`` (or the keyword ``token_ids``): a prompt-only request
        that samples nothing. Its :class:`CompletionResult` (awaited, with
        :class:`AsyncClient`) carries ``embedding``, the final hidden states (after the
        model's final norm) pooled by ``pooling`` (``last``: the last prompt position's;
        ``mean``: over the prompt) and L2-normalized; ``usage.prompt_tokens`` counts the prompt."""
        return self._complete(_request_message(prompt, False, {**request, "pooling": pooling, "max_tokens": 1}))

    def stream(self, prompt: str | None = None, **request: Any) -> Any:
        """As :meth:`generate`, streamed: an iterator of :class:`StreamDelta` (async, with
        :class:`AsyncClient`), the last one carrying the finish reason. Stopping early aborts
        the request at the server."""
        return self._stream(_request_message(prompt, True, request))

    def abort(self, request_id: str) -> Any:
        """Abort a request of this client; its id is free for reuse at once."""
        return self._abort(request_id)

    def stats(self, *, iterations: bool = False) -> Any:
        """The server's block pool, queues and counters (docs/protocol.md, ``stats``);
        ``iterations`` adds ``iterations``, the log of the most recent iterations (up to 256
        maps: batch, tokens, blocks and waits of each)."""
        return self._command(CONTROL_KEYS[wire.STATS_REPLY], stats_message(iterations))

    def profile(self, window_s: float = 60.0, *, trace: bool = False, series: list[str] | None = None) -> Any:
        """Every process's latency profile over the last ``window_s`` s (docs/protocol.md, ``profile``).

        ``trace`` adds each process's recent spans (``conveyor.profiling.chrome_trace``
        turns the reply's ``processes`` into one Chrome/Perfetto trace); ``series`` names value
        series whose raw samples to include, e.g. ``["batch_seqs"]``.
        """
        return self._command(CONTROL_KEYS[wire.PROFILE_REPLY], profile_message(window_s, trace, series))

    def load_lora(self, name: str, path: str | os.PathLike) -> Any:
        """Load the PEFT LoRA adapter in the directory ``path`` (on the server's host) as
        ``name``, on every replica (docs/protocol.md, ``load_lora``; the server runs with
        --enable-lora-loading): the ``lora`` reply once requests may name it. A refusal
        raises :class:`ServerError` whose ``code`` says why (``lora_already_loaded``,
        ``lora_not_found``, ``invalid_lora``, ``lora_loading_disabled``, ``lora_update_pending``;
        ``timeout``: a replica did not answer, and the load was undone where it was taken)."""
        msg = lora_message(name, os.fspath(path))
        return self._command(msg["request_id"], msg)

    def unload_lora(self, name: str) -> Any:
        """Unload adapter ``name`` (docs/protocol.md, ``unload_lora``): the ``lora`` reply;
        :class:`ServerError` ``lora_in_use`` while requests run or wait under it,
        ``lora_not_found`` for a name not loaded."""
        msg = lora_message(name, None)
        return self._command(msg["request_id"], msg)

    def update_weights(
        self, path: str | os.PathLike | None = None, *, group: dict | None = None, in_flight: str = "finish"
    ) -> Any:
        """New weights in place (docs/rl.md; bin/serve --enable-rl-control): from the checkpoint
        directory ``path`` on the server's host, or a trainer's ``group``
        (:func:`conveyor.client.commands.weight_group`). Requests in flight first ``finish``
        on the old weights, or ``abort``; the prefix cache is dropped. The ``engine`` reply
        (its ``weight_version`` bumped); :class:`ServerError` ``invalid_weights`` /
        ``weights_not_found`` for an update refused whole (the old weights serve on)."""
        msg = rl_message(
            UPDATE_WEIGHTS, path=None if path is None else os.fspath(path), group=group, in_flight=in_flight
        )
        return self._command(msg["request_id"], msg)

    def sleep(self, level: int = 1, *, in_flight: str = "finish") -> Any:
        """Free the KV cache (``level`` 1) and the weights too (2; read again from the served
        checkpoint on wake): the ``engine`` reply with ``freed_bytes``."""
        msg = rl_message(SLEEP, level=level, in_flight=in_flight)
        return self._command(msg["request_id"], msg)

    def wake_up(self) -> Any:
        """Take back what :meth:`sleep` freed; requests held meanwhile run."""
        return self._rl(WAKE_UP)

    def pause(self, mode: str = "abort") -> Any:
        """Stop generating: ``abort`` what runs, ``wait`` for it to finish, or ``keep`` it in
        place until :meth:`resume`. Requests sent while paused wait."""
        msg = rl_message(PAUSE, mode=mode)
        return self._command(msg["request_id"], msg)

    def resume(self) -> Any:
        """Generate again after :meth:`pause`."""
        return self._rl(RESUME)

    def engine_state(self) -> Any:
        """The ``engine`` map: ``weight_version``, ``is_sleeping``, ``sleep_level``, ``is_paused``."""
        return self._rl(ENGINE_STATE)

    def _rl(self, kind: str) -> Any:
        msg = rl_message(kind)
        return self._command(msg["request_id"], msg)

    def tokenize(self, prompt: str | None = None, **fields: Any) -> Any:
        """The server's token ids of an input (docs/protocol.md, ``tokenize``): ``prompt``, or
        the keyword ``messages`` (with the chat template's fields and ``tools``) or
        ``token_ids``; ``add_special_tokens`` False: a prompt without BOS;
        ``return_token_strs``: each id's token too. The ``tokens`` reply; a refusal raises
        :class:`ServerError` with the generate request's message and code."""
        msg = tokenize_message(prompt, fields)
        return self._command(msg["request_id"], msg)

    def detokenize(self, token_ids: list[int]) -> Any:
        """The server's text of ``token_ids``, special tokens kept (docs/protocol.md, ``detokenize``):
        the ``text`` reply."""
        msg = detokenize_message(token_ids)
        return self._command(msg["request_id"], msg)

    def metrics(self) -> Any:
        """The frontend's request-level metrics (docs/protocol.md, ``metrics``): ``counters``
        (``prompt_tokens``, ``generation_tokens``, ``request_success`` by finish reason) and
        ``histograms`` (name -> ``{buckets, counts, sum, count}``, seconds; ``counts`` per
        bucket, not cumulative, its last entry above every bound), all since the server
        started. :func:`conveyor.http.prometheus.exposition` renders it with :meth:`stats`."""
        return self._command(CONTROL_KEYS[wire.METRICS_REPLY], metrics_message())

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
        key = reply_key(reply)
        if reply.get("type") != wire.DELTA:  # its final, or a command's one answer
            self._awaiting.discard(key)
            self._aborted.discard(key)
        if key in self._abandoned:
            if reply.get("type") == wire.FINAL:
                self._abandoned.discard(key)
            return
        self._deliver(key, reply)

    def _fail_awaiting(self) -> None:
        """On the loss of the server (after the replies received before it are routed): every
        request still waiting gets the loss (ServerGoneError in its reader), and nothing is
        awaited any more, since no final will come on the lost connection."""
        for key in self._awaiting:
            self._deliver(key, self._lost(f"request {key!r}" if key not in CONTROL_KEYS.values() else key.strip("_")))
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
