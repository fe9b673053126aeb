"""A bin/serve process tree started by the benchmark, the way a user starts one.

It listens on a private ``ipc://`` socket in a temporary directory, so a benchmark never
collides with a server already on the default port, and it is always stopped (SIGTERM,
then SIGKILL) when the ``with`` block ends, also on an exception or Ctrl-C. Its stdout and
stderr go to a log file, never a pipe: a benchmark that dies must not leave a server
blocked on (or failing at) a write to a pipe nobody reads.

What bin/serve prints there is the server's own account of itself: the pid of each process
(``conveyor: NAME ready (pid N)``), read for :meth:`BenchServer.cpu_seconds`, and with
``--http-port`` the URL of its OpenAI API (:attr:`BenchServer.http_url`; ``--http-port 0``
lets the HTTP process bind a free port, so runs never collide on one).

The log of a failed run (bin/serve not ready, exited on its own, or the ``with`` block left
by an exception) outlives the temporary directory: it is copied to ``$CONVEYOR_SERVE_LOG_DIR``
(default: the system's temporary directory) and its tail printed, so a worker's traceback
is never lost with the directory.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
_PID_LINE = re.compile(r"conveyor: (\w+) ready \(pid (\d+)\)")
_API_MARKER = "OpenAI-compatible API on "
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ServeError(RuntimeError):
    """bin/serve did not come up; the message ends with the tail of its log."""


class BenchServer:
    """``python -m conveyor.cli.serve`` with ``args``; ``address`` is where clients connect."""

    def __init__(self, args: list[str]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="conveyor-bench-")
        self.address = f"ipc://{self._dir.name}/client.sock"
        self.log_path = Path(self._dir.name) / "serve.log"
        self.args = list(args)
        self.proc: subprocess.Popen | None = None
        self.ready_line = ""
        self.pids: dict[str, int] = {}
        self.http_url: str | None = None

    def __enter__(self) -> BenchServer:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(failed=exc_type is not None)

    def start(self) -> None:
        cmd = [sys.executable, "-m", "conveyor.cli.serve", "--host", self.address, *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w", encoding="utf-8") as log:
            # A session of its own, as the other systems' servers and a user's shell get: with the
            # kernel's autogroup scheduling (Linux's default) CPU time is shared per session first,
            # so a server in the benchmark's session would share its slice with the load generator
            # and --busy-cores' spinners while vLLM's had a slice to itself.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not self.ready_line and self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                self.ready_line = next((ln for ln in self._log_lines() if " ready on " in ln), "")
        except BaseException:  # Ctrl-C or a stage's SIGINT while starting: no orphaned server
            self.stop(failed=True)
            raise
        if not self.ready_line or self.proc.poll() is not None:
            tail = self.log_tail()
            self.stop(failed=True)
            raise ServeError(f"bin/serve {' '.join(self.args)} did not become ready:\n{tail}")
        # Every line before the ready line is written by then (one log, flushed per line).
        for line in self._log_lines():
            if (m := _PID_LINE.search(line)) is not None:
                self.pids[m.group(1)] = int(m.group(2))
            elif _API_MARKER in line:
                self.http_url = line.split(_API_MARKER, 1)[1].split("/v1", 1)[0].strip()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each server process has used so far, by process name,
        from /proc (empty where there is none); a difference of two readings is a run's cost."""
        out = {}
        for name, pid in self.pids.items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[name] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
        return out

    def stop(self, failed: bool = False) -> None:
        """Stop the server; ``failed`` (or a server that had already exited) keeps its log."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is not None:
            failed = True
        elif proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if failed and self.log_path.exists():
            self.keep_log()
        self._dir.cleanup()

    def keep_log(self) -> Path:
        """Copy the log out of the temporary directory and print where, with its tail."""
        keep_dir = Path(os.environ.get("CONVEYOR_SERVE_LOG_DIR") or tempfile.gettempdir())
        keep_dir.mkdir(parents=True, exist_ok=True)
        kept = keep_dir / f"serve-failed-{os.getpid()}-{time.strftime('%H%M%S')}-{id(self) % 10000}.log"
        shutil.copyfile(self.log_path, kept)
        print(f"bin/serve's log kept at {kept}; its tail:\n{self.log_tail()}", file=sys.stderr)
        return kept

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self._log_lines()[-lines:]) or "(no log)"
