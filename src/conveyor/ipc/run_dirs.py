"""Run directories: made private, claimed by their owner, and reaped once their owner is gone.

A server's run directory holds its ipc sockets and, on tmpfs, its step rings (else the rings
live in ``/dev/shm`` named after it, :func:`conveyor.ipc.shm_ring.ring_path`). bin/serve removes
both when it stops, but a bin/serve killed with ``-9`` cannot: its directory and rings (some
MB of shared memory each) stayed for good, 3 of 3 times in issue 43's attack run. So each run
directory holds an :data:`OWNER_FILE` naming the process that made it (pid and start time,
so a reused pid is not taken for it), and :func:`make_run_dir` first reaps every run directory
of this user, in the same base directory, whose owner is no longer running, with its rings.
A directory without an owner file (made by an older version, or still being made) is left
alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from conveyor.ipc.shm_ring import pid_alive, process_start_time

log = logging.getLogger("conveyor")

PREFIX = "conveyor-"
OWNER_FILE = "owner"
SHM_DIR = "/dev/shm"


def base_dir() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


def make_run_dir() -> str:
    """A fresh private directory for the ipc sockets (0700; short path, ipc paths are
    limited), claimed by this process; stale ones of dead owners are reaped first."""
    base = base_dir()
    reap_stale(base)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    os.chmod(path, 0o700)
    pid = os.getpid()
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(f"{pid} {process_start_time(pid)}\n")
    return path


def reap_stale(base: str) -> list[str]:
    """Remove the run directories in ``base`` (ours, with an owner file) whose owner is not
    running, and their rings in /dev/shm; the paths removed."""
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        path = os.path.join(base, name)
        try:
            if os.stat(path).st_uid != uid or not os.path.isdir(path):
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid, started = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue  # not ours, not a run directory, or not claimed (yet)
        if pid_alive(pid, started):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        removed += _remove_rings_of(name)
    if removed:
        log.info("removed %d file(s) left by servers that did not stop cleanly: %s", len(removed), ", ".join(removed))
    return removed


def _remove_rings_of(run_dir_name: str) -> list[str]:
    """The /dev/shm rings (and their bells) named after run directory ``run_dir_name``."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(run_dir_name + "-"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(os.path.join(SHM_DIR, name))
            except OSError:
                pass
    return removed
