"""The HTTP process's line to the frontend: one :class:`conveyor.client.AsyncClient`.

Every request of every HTTP connection travels on the one client (one DEALER socket, replies
routed by request id). Its ``stats`` and ``metrics`` queries are keyed by their type, so at
most one of each may be in flight: :class:`FrontendLink` runs each as one shared task that
every concurrent caller awaits (shielded, each with its own deadline), which also keeps a
burst of health probes at one query.

Readiness: the server counts as started once a ``stats`` query has been answered, which
takes the frontend (it relays the query), the scheduler (it answers) and so the worker (the
scheduler starts only after the worker is ready). Until then generation is refused with 503.
Health is the same query with a deadline of :data:`HEALTH_TIMEOUT_S`, asked every time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from conveyor.client import DEFAULT_TIMEOUT_S, AsyncClient, ServerError
from conveyor.http.errors import ApiError, unavailable
from conveyor.ipc import transport
from conveyor.protocol import wire

HEALTH_TIMEOUT_S = 1.0
# Codes of an ``error`` map that blame the message (its size, shape or fields), not the server.
_CLIENT_FAULTS = frozenset(
    {wire.MALFORMED, wire.TOO_LARGE, wire.INVALID_FIELD, wire.INVALID_INPUT, wire.PROMPT_TOO_LONG}
)
# A shared query gives up after this long (a caller's own deadline is usually shorter).
QUERY_TIMEOUT_S = 10.0
# How long a request's first send waits for the ZeroMQ handshake with the frontend.
CONNECT_TIMEOUT_S = 2.0


class FrontendLink:
    """The client, the shared queries and the started flag. Create it on the running loop."""

    def __init__(self, address: str, auth_keys: str | None = None) -> None:
        """``auth_keys``: the server's --auth-keys directory; the link then connects with the
        server's own key pair, which the frontend allows."""
        keys = {}
        if auth_keys is not None:
            keys = {
                "client_key": transport.server_secret_key_file(auth_keys),
                "server_key": transport.server_public_key_file(auth_keys),
            }
        self.client = AsyncClient(address, timeout=DEFAULT_TIMEOUT_S, connect_timeout=CONNECT_TIMEOUT_S, **keys)
        self.started = False
        self._queries: dict[str, asyncio.Future] = {}

    async def stats(self, timeout: float) -> dict[str, Any]:
        """The server's ``stats`` (scheduler pool and queues); TimeoutError past ``timeout``."""
        stats = await self._shared("stats", self.client.stats, timeout)
        self.started = True
        return stats

    async def metrics(self, timeout: float) -> dict[str, Any]:
        """The frontend's request-level ``metrics`` (counters and histograms)."""
        return await self._shared("metrics", self.client.metrics, timeout)

    async def healthy(self) -> bool:
        """Whether the frontend relayed a ``stats`` query the scheduler answered in time, with
        no worker hung (``num_hung``, conveyor.scheduler.liveness)."""
        try:
            stats = await self.stats(HEALTH_TIMEOUT_S)
        except (
            asyncio.TimeoutError,
            TimeoutError,
            ConnectionError,
            ServerError,
        ):  # ConnectionError: none, lost, refused
            return False
        return not stats.get("num_hung")

    async def require_started(self) -> None:
        """Return once the server has answered a query; a 503 while it is starting."""
        if not self.started and not await self.healthy():
            raise unavailable("the server is starting (or a process is not answering); retry later", "starting")

    async def close(self) -> None:
        for query in self._queries.values():
            query.cancel()
        await self.client.close()

    async def _shared(self, name: str, ask: Callable[[], Awaitable[dict[str, Any]]], timeout: float) -> dict[str, Any]:
        query = self._queries.get(name)
        if query is None or query.done():
            query = self._queries[name] = asyncio.ensure_future(asyncio.wait_for(ask(), QUERY_TIMEOUT_S))
            query.add_done_callback(_retrieve)  # a failure every caller stopped waiting for is no warning
        return await asyncio.wait_for(asyncio.shield(query), timeout)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP error for a failure of the client itself (not a request's error final)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ConnectionError):  # NoServerError, ServerGoneError, AuthenticationError
        return unavailable(f"the server is not reachable: {exc}", "unreachable")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return unavailable(f"the server did not answer: {exc}", "timeout")
    if isinstance(exc, ServerError):  # an error map: the message itself was refused
        if exc.code in _CLIENT_FAULTS:
            return ApiError(400, f"the request was refused: {exc}", code=exc.code)
        return ApiError(500, f"server error: {exc}", code="internal_error")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def _retrieve(query: asyncio.Future) -> None:
    if not query.cancelled():
        query.exception()
