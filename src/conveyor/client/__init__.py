"""Python clients for a running Conveyor server (``conveyor.client``).

``Client`` is synchronous and ``AsyncClient`` is for asyncio; both speak the
msgpack protocol of docs/protocol.md over one ZeroMQ DEALER socket, so many
requests can be in flight on one client at once. Keyword arguments of
``generate``/``stream`` are the request fields of the protocol (max_tokens,
temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, n, priority ...).
With ``n`` > 1 a result has ``n`` :class:`Choice` objects (``CompletionResult.choices``) and
each streamed :class:`StreamDelta` names its sequence (``index``). ``embed`` asks for an
embedding (a prompt-only pooling request; its result's ``embedding``).
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

The package: :mod:`~conveyor.client.connection` holds what both clients share (the
connection, request bookkeeping, reply routing, messages), :mod:`~conveyor.client.results`
what replies become;
:mod:`~conveyor.client.sync` and :mod:`~conveyor.client.aio` add only their I/O.
"""

from conveyor.client.aio import AsyncClient
from conveyor.client.connection import (
    DEFAULT_ADDRESS,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_LIVENESS_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    AuthenticationError,
    Choice,
    CompletionResult,
    NoServerError,
    ServerError,
    ServerGoneError,
    StreamDelta,
    Usage,
    generate_message,
)
from conveyor.client.sync import Client

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "AuthenticationError",
    "Choice",
    "Client",
    "CompletionResult",
    "NoServerError",
    "ServerError",
    "ServerGoneError",
    "StreamDelta",
    "Usage",
    "generate_message",
]
