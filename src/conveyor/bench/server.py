"""A bin/serve process tree started by the benchmark, the way a user starts one.

It listens on a private ``ipc://`` socket in a temporary directory, so a benchmark never
collides with a server already on the default port, and it is always stopped (SIGTERM,
then SIGKILL) when the ``with`` block ends, also on an exception or Ctrl-C. Its stdout and
stderr go to a log file, never a pipe: a benchmark that dies must not leave a server
blocked on (or failing at) a write to a pipe nobody reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0


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

    def __enter__(self) -> BenchServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "conveyor.cli.serve", "--host", self.address, *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready_line and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            self.ready_line = next((ln for ln in self._log_lines() if " ready on " in ln), "")
        if not self.ready_line or self.proc.poll() is not None:
            tail = self.log_tail()
            self.stop()
            raise ServeError(f"bin/serve {' '.join(self.args)} did not become ready:\n{tail}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._dir.cleanup()

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self._log_lines()[-lines:]) or "(no log)"
