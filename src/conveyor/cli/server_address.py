"""The flags every command that talks to a running server shares: where it is, how long to wait."""

from __future__ import annotations

import argparse

from conveyor.client import DEFAULT_CONNECT_TIMEOUT_S
from conveyor.ipc.transport import client_address


def add_address_arguments(p: argparse.ArgumentParser) -> None:
    """``--host``/``--port``, or a full address in ``--host``: read back by :func:`server_address`."""
    p.add_argument("--host", default="127.0.0.1", help="server host, or a full tcp:// / ipc:// address")
    p.add_argument("--port", type=int, default=7700)


def add_server_arguments(p: argparse.ArgumentParser, *, timeout_s: float, timeout_help: str) -> None:
    """The address, ``--timeout`` (per reply) and ``--connect-timeout`` (for a server to be there at all)."""
    add_address_arguments(p)
    p.add_argument("--timeout", type=float, default=timeout_s, help=timeout_help)
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for a server to answer at all",
    )


def server_address(args: argparse.Namespace) -> str:
    return client_address(args.host, args.port)
