"""Python clients for a running Conveyor server (``conveyor.client``).

``Client`` is synchronous and ``AsyncClient`` is for asyncio; both speak the
msgpack protocol of docs/protocol.md over one ZeroMQ DEALER socket, so many
requests can be in flight on one client at once. Keyword arguments of
``generate``/``stream`` are the request fields of the protocol (max_tokens,
temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, priority).
Sending ``request_id`` of a finished request continues it (docs/protocol.md).

A server that goes silent for ``timeout`` seconds raises :class:`TimeoutError`
instead of hanging the caller; the request is aborted on the way out. An address where no
server answers at all raises :class:`NoServerError` within ``connect_timeout`` seconds
instead: a ZeroMQ connect never fails by itself (it retries in the background), so a
client's first send waits at most that long for the ZeroMQ handshake with the server (seen
on a socket monitor), which the server's I/O thread completes at once however busy its loop
is. This is about the server answering at all, never about how long a reply takes: a slow
first token (a long prompt's prefill) is still waited for up to ``timeout``. Once the
handshake is seen the monitor is gone and a send costs what it did before.
A zmq socket is not thread-safe: use one ``Client`` per thread.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import zmq
import zmq.asyncio

from conveyor.protocol import messages as cp

DEFAULT_ADDRESS = "tcp://127.0.0.1:7700"
DEFAULT_TIMEOUT_S = 300.0
# How long a send waits for a connection to the server (a local one completes in about a
# millisecond; a server still starting has this long to bind its socket).
DEFAULT_CONNECT_TIMEOUT_S = 5.0


class ServerError(RuntimeError):
    """The server answered with a protocol-level error that names no request."""


class NoServerError(ConnectionError):
    """Nothing answered at the client's address: no server is listening there (or it died)."""

    def __init__(self, address: str, connect_timeout: float) -> None:
        super().__init__(f"no server at {address} (no connection within {connect_timeout:g} s)")
        self.address = address


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
        raise ServerError(msg.get("message", "unknown server error"))


def _connect(ctx: zmq.Context, address: str, connect_timeout: float | None) -> tuple[zmq.Socket, zmq.Socket | None]:
    """The DEALER socket of a client, connected to ``address``, and with ``connect_timeout`` a
    monitor socket that reports the handshake with the server (None: the first send queues
    for a server that may come later, as long as it takes). The monitor starts before the
    connect, so the event cannot be missed."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    monitor = None if connect_timeout is None else sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    return sock, monitor


def _stop_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)


class _Connection:
    """What both clients hold: one DEALER socket to ``address`` and, until the server is
    known to be there, the monitor that tells (see :func:`_connect`)."""

    def __init__(self, ctx: zmq.Context, address: str, timeout: float | None, connect_timeout: float | None) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._ctx = ctx
        self._sock, self._monitor = _connect(ctx, address, connect_timeout)

    def _close_socket(self) -> None:
        if self._monitor is not None:
            _stop_monitor(self._sock, self._monitor)
            self._monitor = None
        self._sock.close(linger=0)


class Client(_Connection):
    """Synchronous client. Replies for other requests of this client are buffered, not lost."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        super().__init__(zmq.Context.instance(), address, timeout, connect_timeout)
        self._inbox: dict[str | None, collections.deque] = collections.defaultdict(collections.deque)
        self._abandoned: set[str] = set()

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
        if self._monitor is not None:
            self._await_server()
        self._sock.send(cp.pack(msg))

    def _await_server(self) -> None:
        """Wait up to ``connect_timeout`` for the handshake with the server, once per client."""
        if not self._monitor.poll(int(self.connect_timeout * 1000)):
            raise NoServerError(self.address, self.connect_timeout)
        _stop_monitor(self._sock, self._monitor)
        self._monitor = None

    def _abandon(self, request_id: str) -> None:
        """Abort a request nobody will read any more; its late replies are dropped on arrival.

        The server sends every request exactly one final, and all of it before anything of a
        later request of this client that reuses the id, so "drop up to its final" is exact;
        a final already buffered means there is nothing left to drop.
        """
        self.abort(request_id)
        if not any(reply["type"] == cp.FINAL for reply in self._inbox.pop(request_id, ())):
            self._abandoned.add(request_id)

    def _next(self, key: str) -> dict[str, Any]:
        """The next message for ``key`` (a request id, or "__stats__"), buffering others."""
        while not self._inbox[key]:
            if not self._sock.poll(None if self.timeout is None else int(self.timeout * 1000)):
                if key not in _CONTROL_KEYS.values():
                    self._abandon(key)
                raise TimeoutError(f"no reply from {self.address} within {self.timeout} s")
            reply = cp.unpack_map(self._sock.recv())
            _check_error(reply)
            target = _reply_key(reply)
            if target in self._abandoned:
                if reply.get("type") == cp.FINAL:
                    self._abandoned.discard(target)
                continue
            self._inbox[target].append(reply)
        reply = self._inbox[key].popleft()
        if not self._inbox[key]:
            del self._inbox[key]
        return reply


class AsyncClient(_Connection):
    """asyncio client: one reader task routes replies to the awaiting request."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        super().__init__(zmq.asyncio.Context.instance(), address, timeout, connect_timeout)
        self._awaiting_server = asyncio.Lock()  # one waiter reads the monitor; the others find it gone
        self._queues: dict[str, asyncio.Queue] = {}
        self._abandoned: set[str] = set()  # ids whose final is still to come, for nobody
        self._reader: asyncio.Task | None = None

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
        if self._reader is not None:
            self._reader.cancel()
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
        if self._monitor is not None:
            await self._await_server()
        await self._sock.send(cp.pack(msg))

    async def _await_server(self) -> None:
        """As :meth:`Client._await_server`; requests sent at once wait for the one handshake."""
        async with self._awaiting_server:
            if self._monitor is None:
                return  # seen while this one waited for the lock
            if not await self._monitor.poll(int(self.connect_timeout * 1000)):
                raise NoServerError(self.address, self.connect_timeout)
            _stop_monitor(self._sock, self._monitor)
            self._monitor = None

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
        """Hand ``reply`` to the queue of its request (or command); an error that names no
        request to every queue; a reply of an abandoned request is dropped."""
        if reply.get("type") == cp.ERROR and reply.get("request_id") is None:
            for queue in self._queues.values():
                queue.put_nowait(reply)
            return
        key = _reply_key(reply)
        if key in self._abandoned:
            if reply.get("type") == cp.FINAL:
                self._abandoned.discard(key)
            return
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
        ended = False
        while not queue.empty():  # a final already received: nothing more will come
            ended = queue.get_nowait().get("type") == cp.FINAL or ended
        if not ended:
            self._abandoned.add(request_id)  # (no await since the check: the reader cannot interleave)
        await self.abort(request_id)
