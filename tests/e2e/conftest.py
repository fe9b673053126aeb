"""Fixtures that run bin/serve as a user would: a real subprocess tree on a real checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

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
        for line in self.stderr:
            if f"conveyor: {name} ready (pid " in line:
                return int(line.split("(pid ")[1].split(")")[0])
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


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers, with the demo tokenizer beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conveyor.common.demo import checkpoint as demo

    path = tmp_path_factory.mktemp("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.TOKENIZER_DIR / name, path / name)
    from conveyor.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def start_server(tmp_path: Path, *args: str) -> ServeProcess:
    return ServeProcess([*args], tmp_path)


@pytest.fixture
def serve_factory(tmp_path):
    """Start bin/serve with given flags; every server started is torn down and checked for orphans."""
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        server = ServeProcess(list(args), tmp_path)
        started.append(server)
        return server

    yield start
    for server in started:
        kids = list(server.pids.values())
        if server.proc.poll() is None:
            server.terminate()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in kids if alive(p)]
        if left:
            server.kill()
        assert not left, f"orphaned processes after shutdown: {left}"
