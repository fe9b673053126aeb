"""bin/serve in a subprocess, and /proc helpers to prove no process outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVE = REPO / "bin" / "serve"
READY_TIMEOUT_S = 180


def children_of(pid: int) -> list[int]:
    """All descendants of ``pid`` found through /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_dir_of(frontend_pid: int) -> str:
    """The run directory of the server whose frontend is ``frontend_pid``: where the ipc
    sockets it bound are (its unix sockets, matched by inode in /proc/net/unix)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{frontend_pid}/fd"):
        try:
            target = os.readlink(f"/proc/{frontend_pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[7].endswith("/to-frontend"):
                return os.path.dirname(fields[7])
    raise AssertionError(f"no run directory found for frontend {frontend_pid}")


def mapped_ring_files(pid: int) -> set[str]:
    """The shared-memory ring files process ``pid`` has mapped (its own server's, whatever
    else runs on this host)."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and line.rstrip().endswith(".ring")}


class ServeProcess:
    """bin/serve in a subprocess; ``address`` is the client address it printed as ready."""

    def __init__(self, args: list[str], tmp: Path) -> None:
        self.address = f"ipc://{tmp}/client.sock"
        cmd = [sys.executable, str(SERVE), "--host", self.address, *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr, False), daemon=True).start()
        if not self._ready.wait(READY_TIMEOUT_S) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"bin/serve did not become ready:\n{self.output()}")
        self.pids = {name: self._pid_of(name) for name in ("worker", "scheduler", "frontend")}

    def _pump(self, stream, sink: list[str], watch_ready: bool) -> None:
        for line in stream:
            sink.append(line)
            if watch_ready and "ready" in line:
                self._ready.set()
        self._ready.set()  # EOF: unblock the waiter, which then sees the exit

    def _pid_of(self, name: str) -> int:
        deadline = time.monotonic() + 10  # stderr is pumped by another thread: it may lag stdout
        while time.monotonic() < deadline:
            for line in list(self.stderr):
                if f"conveyor: {name} ready (pid " in line:
                    return int(line.split("(pid ")[1].split(")")[0])
            time.sleep(0.02)
        raise AssertionError(f"no pid line for {name}:\n{self.output()}")

    def output(self) -> str:
        return "".join(self.stdout) + "".join(self.stderr)

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        for pid in children_of(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait(10)


