"""The flags every command that talks to a running server shares: where it is, how long to
wait, and the key pair of a server run with ``--auth-keys``."""

from __future__ import annotations

import argparse
from typing import Any

from conveyor.client import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_LIVENESS_TIMEOUT_S
from conveyor.ipc.transport import client_address


def add_address_arguments(p: argparse.ArgumentParser) -> None:
    """``--host``/``--port``, or a full address in ``--host``: read back by :func:`server_address`."""
    p.add_argument("--host", default="127.0.0.1", help="server host, or a full tcp:// / ipc:// address")
    p.add_argument("--port", type=int, default=7700)


def add_server_arguments(p: argparse.ArgumentParser, *, timeout_s: float, timeout_help: str) -> None:
    """The address, ``--timeout`` (per reply), ``--connect-timeout`` (for a server to be there
    at all), ``--liveness-timeout`` and the key pair: read back by :func:`client_options`."""
    add_address_arguments(p)
    g = p.add_argument_group("connection")
    g.add_argument("--timeout", type=float, default=timeout_s, help=timeout_help)
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for a server to answer at all",
    )
    g.add_argument(
        "--liveness-timeout",
        type=float,
        default=DEFAULT_LIVENESS_TIMEOUT_S,
        help="seconds a connection that answers no heartbeat counts as alive",
    )
    g.add_argument(
        "--client-key",
        metavar="FILE",
        help="this client's key pair (a NAME.key_secret from bin/keygen), for a server run with --auth-keys",
    )
    g.add_argument(
        "--server-key", metavar="FILE", help="the server's public key (its DIR/server.key), with --client-key"
    )


def client_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~conveyor.client.Client` keyword arguments :func:`add_server_arguments`'
    flags give (a usage error when only one of the key files is given)."""
    if (args.client_key is None) != (args.server_key is None):
        p.error("--client-key and --server-key go together")
    return {
        "timeout": args.timeout,
        "connect_timeout": args.connect_timeout,
        "liveness_timeout": args.liveness_timeout,
        "client_key": args.client_key,
        "server_key": args.server_key,
    }


def server_address(args: argparse.Namespace) -> str:
    return client_address(args.host, args.port)
