"""ZeroMQ plumbing shared by the processes: addresses, sockets, typed send.

Inside one server every hop is an ``ipc://`` socket in a private run directory
(mode 0700, so other users cannot connect). Hops are PUSH/PULL pairs: each
direction has one writer and one reader, so no routing is needed and a slow
reader applies back-pressure instead of dropping messages. The scheduler <-> worker
hop goes through :mod:`conveyor.ipc.step_channel`, which uses the ``plans`` and
``results`` sockets alone (``--plan-transport zmq``) or beside its shared-memory rings.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq

from conveyor.ipc import codec


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
        )


def make_run_dir() -> str:
    """A fresh private directory for the ipc sockets (0700; short path, ipc paths are limited)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix="conveyor-", dir=base)
    os.chmod(path, 0o700)
    return path


def client_address(host: str, port: int) -> str:
    """``tcp://host:port``; a host that already names a transport (``ipc://...``) is used as is."""
    if "://" in host:
        return host
    return f"tcp://{host}:{port}"


def socket(ctx: zmq.Context, kind: int, address: str, *, bind: bool) -> zmq.Socket:
    """A socket that never blocks close (linger 0) and has no high-water-mark drops on PUSH."""
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

