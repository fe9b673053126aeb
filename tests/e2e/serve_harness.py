"""bin/serve in a subprocess, /proc helpers to prove no process outlives it, and the
kill-a-process-mid-stream scenario the fault tests share."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from conveyor.client import AsyncClient, Client

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


def still_alive_after(pids: list[int], timeout: float) -> list[int]:
    """The processes of ``pids`` still alive after waiting up to ``timeout`` s for all to exit."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


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
        return {
            line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and line.rstrip().endswith(".ring")
        }


# A request that would run far longer than any test waits: its disconnect, not its end, frees it.
LONG_MODEL_LEN = 4096
LONG_MAX_TOKENS = 4000  # ~16 s of decoding at the tiny model's ~250 tok/s on this CPU
LONG_SERVE_ARGS = (
    "--max-model-len",
    str(LONG_MODEL_LEN),
    "--num-kv-blocks",
    "300",
    "--block-size",
    "16",
    "--threads",
    "1",
)
ABORT_BOUND_S = 1.0  # disconnect -> the request's KV blocks free (docs/reliability.md)


def long_context_copy(checkpoint: Path, dst: Path) -> Path:
    """``checkpoint`` (its files copied into ``dst / checkpoint.name``, so the served model's
    name is the same) with ``max_position_embeddings`` raised to LONG_MODEL_LEN: the weights of
    a RoPE model do not depend on it, only the length a request may run to."""
    out = dst / checkpoint.name
    shutil.copytree(checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = LONG_MODEL_LEN
    (out / "config.json").write_text(json.dumps(config))
    return out


def finished_counts(client: Client) -> dict[str, int]:
    """The server's requests ended so far, by finish reason (the ``metrics`` counters)."""
    return client.metrics()["counters"]["request_success"]


def wait_until_freed(watcher: Client, since: float, event: str) -> float:
    """Poll ``watcher``'s stats until no KV block is held and nothing is in flight; fails once
    ABORT_BOUND_S have passed since ``since`` (``time.monotonic`` of ``event``, as the message
    names it). Returns the seconds it took."""
    while True:
        stats = watcher.stats()
        took = time.monotonic() - since
        if stats["held_blocks"] == 0 and stats["in_flight"] == 0:
            return took
        assert took < ABORT_BOUND_S, f"blocks still held {took:.2f} s after {event}: {stats}"
        time.sleep(0.01)


def assert_aborted_and_freed(watcher: Client, before: dict[str, int], dropped_at: float) -> float:
    """After one long request's client went away at ``dropped_at`` (``time.monotonic``): its
    KV blocks are free and nothing is in flight within ABORT_BOUND_S of that, and the server
    counted it as aborted (one more ``abort``, no ``length``: it did not just run out).
    ``watcher`` is a client connected before the drop; returns the seconds it took."""
    took = wait_until_freed(watcher, dropped_at, "the disconnect")
    after = finished_counts(watcher)
    assert after["abort"] == before["abort"] + 1 and after["length"] == before["length"], (before, after)
    return took


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A raw DEALER socket connected to a server's client ``address``, for tests that send
    frames by hand (malformed ones included) rather than through conveyor.client."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


async def kill_during_streams(
    address: str, pid: int, num_requests: int, max_tokens: int, timeout: float
) -> list[tuple[object, float]]:
    """SIGKILL process ``pid`` of the server at ``address`` once each of ``num_requests``
    greedy streams (of ``max_tokens``, far more than arrive before the kill) has its first
    token: each request's outcome (its last Delta, or the exception the client raised) and
    the seconds from the kill to it. ``timeout`` is the client's: a request that hangs fails
    as TimeoutError."""
    async with AsyncClient(address, timeout=timeout) as client:
        in_flight = asyncio.Semaphore(0)
        killed_at: list[float] = []

        async def long_request(i: int) -> tuple[object, float]:
            last = None
            try:
                async for delta in client.stream(
                    token_ids=[4 + i] * 10, max_tokens=max_tokens, ignore_eos=True, temperature=0
                ):
                    if last is None:
                        in_flight.release()
                    last = delta
            except Exception as exc:  # what the client raised is the outcome checked
                last = exc
            return last, time.monotonic() - killed_at[0]

        tasks = [asyncio.ensure_future(long_request(i)) for i in range(num_requests)]
        for _ in tasks:  # every request is in flight before the kill
            await in_flight.acquire()
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        return await asyncio.gather(*tasks)


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

    def shut_down(self, pids: list[int]) -> None:
        """Stop the server (SIGTERM, unless it has exited) and assert that none of ``pids``
        outlives it by 10 s; the tree is SIGKILLed first if any does, so nothing is left."""
        if self.proc.poll() is None:
            self.terminate()
        left = still_alive_after(pids, 10)
        if left:
            self.kill()
        assert not left, f"orphaned processes after shutdown: {left}"

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
