"""The harness of a child process: die with the parent, log, report ready or failed, clean up.

:func:`run_process` is every child's main (frontend, scheduler, worker); the process itself
supplies only how it starts (:class:`Started`: what to run, what to close, what to report).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from conveyor.ipc import transport
from conveyor.ipc.messages import ProcessFailed, ProcessReady
from conveyor.ipc.step_channel import PeerGone
from conveyor.runtime.model_source import StartupError

_PR_SET_PDEATHSIG = 1
# bin/serve --debug sets it for its children: an expected start-up error's traceback is logged too.
DEBUG_ENV = "CONVEYOR_DEBUG"
SHUTDOWN_GRACE_S = 3.0  # how long stopped children may take to exit before they are killed


# The exit status of a process that stopped the server because a peer hung (--on-hang exit:
# conveyor.scheduler.liveness, conveyor.frontend.liveness); bin/serve names the cause.
HANG_EXIT_CODE = 3


def run_entry(entry: str, config: object) -> None:
    """Run child body ``entry`` (``"module:function"``) with ``config``: the spawn target of
    every bin/serve child, so that bin/serve imports none of their modules (the worker's torch,
    the HTTP process's aiohttp, the frontend's tokenizers: seconds before its first child starts)."""
    entry_function(entry)(config)


def entry_function(entry: str) -> Callable[[Any], None]:
    """The child body named ``"module:function"``, imported."""
    module, _, function = entry.partition(":")
    return getattr(importlib.import_module(module), function)


def run_entry_when_sent(entry: str, configs: mp.connection.Connection) -> None:
    """:func:`run_entry` with the config sent later over ``configs`` (a pipe from bin/serve),
    so that the child's interpreter and imports start while bin/serve still waits for what the
    config needs (the scheduler's: the worker's block count). Returns at once when the pipe
    closes unsent: the start-up failed, and bin/serve stops every child."""
    die_with_parent()  # Ctrl-C and bin/serve's death, while waiting too
    body = entry_function(entry)
    try:
        config = configs.recv()
    except EOFError:
        return
    finally:
        configs.close()
    body(config)


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


ReadyInfo = dict[str, int | str | float | bool]


@dataclass(frozen=True)
class Started:
    """A process that started: ``run`` serves until told to stop, ``close`` then releases
    what the start-up opened; ``ready_info`` goes to bin/serve with the ready message."""

    run: Callable[[], None]
    close: Callable[[], None]
    ready_info: ReadyInfo = field(default_factory=dict)


def run_process(
    name: str,
    control_address: str,
    start: Callable[[zmq.Context], Started],
    expected: tuple[type[BaseException], ...] = (),
) -> None:
    """Run one child process from start-up to exit.

    Start-up (``start``, given the process's ZeroMQ context) either reports ready to bin/serve
    with its ``ready_info``, or fails: then the reason goes to bin/serve, which stops the server
    and prints it in one line. An expected failure (a :class:`StartupError`, an address in use,
    or one of ``expected``: a user's mistake the message explains) logs nothing more unless
    $CONVEYOR_DEBUG is set; any other failure logs its traceback. The process returns without
    closing anything (it is exiting, and a context with a half-built socket open would block its
    term). After ready, ``close`` and the context's term always run; a peer process that went away
    (:class:`PeerGone`) ends the process with status 1 and one log line, any other exception with
    its traceback.
    """
    die_with_parent()
    log = setup_logging(name)
    ctx = zmq.Context()
    control = ControlChannel(ctx, control_address, name)
    try:
        started = start(ctx)
    except Exception as exc:
        if not isinstance(exc, (StartupError, transport.AddressInUse, *expected)) or os.environ.get(DEBUG_ENV):
            log.exception("%s failed to start", name)
        control.failed(f"{name}: {exc}")
        return
    control.ready(**started.ready_info)
    try:
        started.run()
    except PeerGone as exc:
        log.error("stopping: %s", exc)
        raise SystemExit(1) from None
    finally:
        started.close()
        control.close()
        ctx.term()


def terminate(procs: list[mp.process.BaseProcess], grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """SIGTERM every one of ``procs`` still alive, give them ``grace_s`` in all to exit, then
    SIGKILL any left (bin/serve's supervisor and the engine's ranks stop children so)."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
