"""Helpers every child process calls first: die with the parent, report ready or failed."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import zmq

from conveyor.ipc import transport
from conveyor.ipc.messages import ProcessFailed, ProcessReady

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ignore SIGINT and ask the kernel to SIGTERM this process when bin/serve dies, even by SIGKILL.

    Without it a killed parent would leave the worker holding GPU memory forever.
    Linux only; elsewhere the parent's own shutdown path is the only guard.
    """
    # Ctrl-C reaches the whole process group; only bin/serve acts on it, and stops us in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def setup_logging(process: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {process}[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    return logging.getLogger(f"conveyor.{process}")


class ControlChannel:
    """The child's one-way line to bin/serve for the ready handshake and startup failures."""

    def __init__(self, ctx: zmq.Context, address: str, process: str) -> None:
        self._sock = transport.socket(ctx, zmq.PUSH, address, bind=False)
        self._process = process

    def ready(self, **info: int | str | float | bool) -> None:
        transport.send(self._sock, ProcessReady(self._process, os.getpid(), dict(info)))

    def failed(self, reason: str) -> None:
        transport.send(self._sock, ProcessFailed(self._process, reason))
        # Give the message time to leave before the process exits (linger is 0 by default).
        self._sock.setsockopt(zmq.LINGER, 2000)

    def close(self) -> None:
        self._sock.close()
