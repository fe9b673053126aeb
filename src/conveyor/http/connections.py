"""Connection limits of the HTTP listeners: slow and idle clients cut off, a cap with a 503.

aiohttp alone reads a request's headers for as long as the client takes (its keep-alive
timer, 3,630 s by default, is the only bound) and accepts connections until the process runs
out of file descriptors: 20,000 half-open connections (slowloris) took the HTTP API down,
``/health`` with it, and nothing was logged. So each listener's connections pass through a
:class:`Guard`:

- **header timeout, idle keep-alive** (``--http-header-timeout``, :data:`HEADER_TIMEOUT_S`): a
  connection must complete a request's headers within this long of opening, or of its previous
  response ending; else it is closed, counted ``header_timeout`` when it had sent part of a
  request, ``idle_timeout`` when it had sent nothing (an idle keep-alive connection, a connect
  that never speaks);
- **body timeout** (``--http-body-timeout``, :data:`BODY_TIMEOUT_S`, in :mod:`conveyor.http.app`): a body must arrive
  within this long of its headers; else a 408 and the connection closed (``body_timeout``);
  and a streamed response's next bytes must be taken within as long once the socket buffers
  are full, else the request is aborted and the connection closed (``not_reading``,
  :mod:`conveyor.http.generation`);
- **connection cap** (``--http-max-connections``, :func:`connection_cap`): past that many open
  connections on a listener a new one is answered ``503`` with ``Connection: close`` at once, unread (``refused``), so
  the process never runs out of descriptors and every connection it keeps is served.

Each cause is logged once (a warning naming the bound) and counted in ``/metrics``
(``conveyor:http_connections_closed_total{cause}``, :func:`conveyor.http.prometheus.exposition`).

How: the listener's protocol factory wraps aiohttp's (``web.Server``) in :class:`_Conn`, which
passes every call on and keeps the timer; the error middleware tells the connection when a
request starts and ends (:meth:`Guard.request_started`, :meth:`Guard.request_ended`), so no
aiohttp internals are touched.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import web

from conveyor.runtime.config import HttpConfig

log = logging.getLogger("conveyor.http")

# Defaults of --http-header-timeout, --http-body-timeout, --http-max-connections.
HEADER_TIMEOUT_S = HttpConfig.http_header_timeout
BODY_TIMEOUT_S = HttpConfig.http_body_timeout
MAX_CONNECTIONS = HttpConfig.http_max_connections
# File descriptors kept for everything but client connections (sockets to the frontend,
# threads, files), out of the soft limit.
RESERVED_FDS = 256

CAUSES = ("header_timeout", "idle_timeout", "body_timeout", "not_reading", "refused")
_WHY = {
    "header_timeout": "a client did not finish a request's headers within --http-header-timeout: its connection "
    "was closed",
    "idle_timeout": "a connection sent nothing for --http-header-timeout (idle keep-alive, or it never spoke): closed",
    "body_timeout": "a client did not send its request body within --http-body-timeout: answered 408, "
    "connection closed",
    "not_reading": "a client did not take its streamed response's bytes within --http-body-timeout: its request "
    "aborted, connection closed",
    "refused": "an HTTP listener is at its connection cap (--http-max-connections): a new connection was answered "
    "503 and closed",
}


def connection_cap(wanted: int = MAX_CONNECTIONS) -> int:
    """Connections one listener keeps open: ``wanted``, or fewer when the file descriptor
    limit (raised to its hard limit first) leaves less room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - RESERVED_FDS) // 2))  # two listeners may share the limit


BODY_TIMEOUT = web.AppKey("body_timeout", float)  # --http-body-timeout


class Counts:
    """The closes of every listener by cause; each cause logged the first time only."""

    def __init__(self) -> None:
        self.closed: Counter[str] = Counter({cause: 0 for cause in CAUSES})
        self.open = 0

    def note(self, cause: str) -> None:
        if not self.closed[cause]:
            log.warning(
                "%s (logged once; counted in /metrics as conveyor:http_connections_closed_total{cause=%r})",
                _WHY[cause],
                cause,
            )
        self.closed[cause] += 1

    def snapshot(self) -> dict[str, Any]:
        return {"open": self.open, "closed": dict(self.closed)}


COUNTS = web.AppKey("counts", Counts)  # the HTTP process's connection counts, for /metrics


class Guard:
    """One listener's connections: the cap, and each one's header/idle timer."""

    def __init__(self, counts: Counts, cap: int, header_timeout: float = HEADER_TIMEOUT_S) -> None:
        self.counts = counts
        self.cap = cap
        self.header_timeout = header_timeout
        self._by_transport: dict[Any, _Conn] = {}

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server``, around aiohttp's ``make``."""

        def protocol() -> asyncio.Protocol:
            if len(self._by_transport) >= self.cap:
                self.counts.note("refused")
                return _Refuse()
            return _Conn(self, make())

        return protocol

    def request_started(self, transport: Any) -> None:
        conn = self._by_transport.get(transport)
        if conn is not None:
            conn.busy += 1
            conn.cancel_timer()

    def request_ended(self, transport: Any) -> None:
        conn = self._by_transport.get(transport)
        if conn is not None:
            conn.busy -= 1
            if not conn.busy:
                conn.start_timer()

    def _opened(self, conn: _Conn) -> None:
        self._by_transport[conn.transport] = conn
        self.counts.open += 1

    def _closed(self, conn: _Conn) -> None:
        if self._by_transport.pop(conn.transport, None) is not None:
            self.counts.open -= 1


class _Conn(asyncio.Protocol):
    """aiohttp's protocol for one connection, every call passed on, plus its timer."""

    def __init__(self, guard: Guard, inner: Any) -> None:
        self.guard, self.inner = guard, inner
        self.transport: Any = None
        self.busy = 0
        self.heard = 0  # bytes since the timer started
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.guard._opened(self)
        self.start_timer()
        self.inner.connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.cancel_timer()
        self.guard._closed(self)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.heard += len(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def start_timer(self) -> None:
        self.cancel_timer()
        self.heard = 0
        self._timer = asyncio.get_running_loop().call_later(self.guard.header_timeout, self._expired)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        self.guard.counts.note("header_timeout" if self.heard else "idle_timeout")
        self.transport.close()


_REFUSAL_BODY = (
    b'{"error":{"message":"the server has too many open connections; retry later",'
    b'"type":"service_unavailable_error","param":null,"code":"too_many_connections"}}'
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
    + f"Content-Length: {len(_REFUSAL_BODY)}\r\n\r\n".encode()
    + _REFUSAL_BODY
)


class _Refuse(asyncio.Protocol):
    """A connection past the cap: the 503 written, the connection closed, nothing read."""

    def connection_made(self, transport: Any) -> None:
        transport.write(_REFUSAL)
        transport.close()
