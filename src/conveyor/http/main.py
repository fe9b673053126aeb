"""Entry point of the HTTP process (started by bin/serve with ``--http-port`` / ``--metrics-port``).

Start-up binds the listening sockets before reporting ready, so a port in use fails the
server's start with the reason, and the ready info carries the bound URLs (port 0 picks a
free one). It needs no other process: bin/serve starts it beside the worker and the
frontend, and until the server answers it refuses generation with 503 (see
:mod:`conveyor.http.link`).

TLS: with ``ssl_certfile``/``ssl_keyfile`` every listener serves HTTPS (the certificate is
loaded at start, so a bad file fails the start with the reason) and the ready URLs say
``https``.

Shutdown: SIGTERM (from bin/serve, or the kernel when bin/serve dies) stops listening and
gives requests in flight :data:`SHUTDOWN_TIMEOUT_S` to end (when a process died the
frontend has failed them already, so their error reaches the client), then cancels the rest.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import socket
import ssl
import time

from aiohttp import web

from conveyor.http.app import GUARD, MAX_WAITING, Access, api_app, metrics_app
from conveyor.http.connections import BODY_TIMEOUT, COUNTS, Counts, Guard, connection_cap
from conveyor.http.link import FrontendLink
from conveyor.http.tokens import Tokens
from conveyor.runtime.config import HttpConfig
from conveyor.runtime.process import Started, run_process

# Below bin/serve's grace period (SHUTDOWN_GRACE_S), after which it kills.
SHUTDOWN_TIMEOUT_S = 2.0
LISTEN_BACKLOG = 1024


def run_http(config: HttpConfig) -> None:
    run_process("http", config.addresses.control, lambda ctx: _start(config))


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as ``host`` resolves)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG, reuse_port=False)
    sock.setblocking(False)
    return sock


def url(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def ssl_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """A server TLS context with the certificate chain (OSError/SSLError for a bad file)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context


class HttpServer:
    """The listeners and the apps behind them, run on one event loop until SIGTERM."""

    def __init__(self, config: HttpConfig) -> None:
        self.config = config
        self.ssl = None if config.ssl_certfile is None else ssl_context(config.ssl_certfile, config.ssl_keyfile)  # type: ignore[arg-type]
        self.api_socket = None if config.http_port is None else listen(config.http_host, config.http_port)
        try:
            self.metrics_socket = None if config.metrics_port is None else listen(config.http_host, config.metrics_port)
        except OSError:
            self.close()
            raise

    def ready_info(self) -> dict[str, str]:
        info = {}
        scheme = "http" if self.ssl is None else "https"
        if self.api_socket is not None:
            info["api"] = url(self.api_socket, scheme)
        if self.metrics_socket is not None:
            info["metrics"] = url(self.metrics_socket, scheme) + "/metrics"
        return info

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        # The client socket's internal endpoint: --client-send-queue does not bound it.
        link = FrontendLink(
            self.config.addresses.internal_client or self.config.addresses.client, self.config.auth_keys
        )
        created = int(time.time())
        tokens = Tokens(self.config.model_dir, self.config.max_model_len, link)
        access = Access.of(self.config.api_keys, self.config.api_key_everywhere)
        apps = []
        if self.api_socket is not None:
            api = functools.partial(
                api_app,
                tool_call_parser=self.config.tool_call_parser,
                strict_fields=self.config.strict_fields,
                reasoning_parser=self.config.reasoning_parser,
            )
            apps.append((api, self.api_socket))
        if self.metrics_socket is not None:
            apps.append((metrics_app, self.metrics_socket))
        runners, listeners = [], []
        config = self.config
        counts, cap = Counts(), connection_cap(config.http_max_connections)
        try:
            for make, sock in apps:
                app = make(
                    link,
                    self.config.served_model_name,
                    self.config.max_model_len,
                    created,
                    tokens,
                    access,
                    loras=self.config.lora_names,
                )
                app[GUARD] = guard = Guard(counts, cap, config.http_header_timeout)
                app[COUNTS] = counts
                app[BODY_TIMEOUT] = config.http_body_timeout
                app[MAX_WAITING] = config.max_waiting
                runner = web.AppRunner(
                    app,
                    handler_cancellation=True,  # a client that goes away cancels its handler, and so its request
                    shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                    access_log=None,
                    keepalive_timeout=config.http_header_timeout + 5,  # the guard's timer closes idle connections first
                )
                await runner.setup()
                runners.append(runner)
                # The listener itself (not an aiohttp site): its protocols go through the guard.
                listeners.append(
                    await loop.create_server(
                        guard.factory(runner.server), sock=sock, ssl=self.ssl, backlog=LISTEN_BACKLOG
                    )
                )
            await stop.wait()
        finally:
            for listener in listeners:
                listener.close()
            await asyncio.gather(*(runner.cleanup() for runner in runners))  # in parallel: one grace period
            await link.close()

    def close(self) -> None:
        for sock in (self.api_socket, getattr(self, "metrics_socket", None)):
            if sock is not None:
                sock.close()


def _start(config: HttpConfig) -> Started:
    import uvloop

    server = HttpServer(config)
    return Started(run=lambda: uvloop.run(server.run()), close=server.close, ready_info=server.ready_info())
