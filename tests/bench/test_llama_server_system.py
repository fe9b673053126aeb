"""bin/bench's llama-server system (conveyor_tools.bench.llama_server): the GGUF file it
serves, a clear error when its binary is missing or does not start, no process left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor_tools.bench.llama_server import LlamaServer, gguf_file
from conveyor_tools.bench.server import ServeError
from conveyor_tools.bench.vllm_server import _process_group
from conveyor_tools.cli.bench_options import ALL_SYSTEMS


def test_llama_server_is_a_system() -> None:
    assert "llama-server" in ALL_SYSTEMS


def test_the_gguf_file_of_a_file_or_a_directory_holding_one(tmp_path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert gguf_file(str(model)) == model and gguf_file(str(tmp_path)) == model
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ServeError, match="--model FILE.gguf"):
        gguf_file(str(tmp_path))  # two: which one is not ours to guess
    with pytest.raises(ServeError, match="--model FILE.gguf"):
        gguf_file(str(tmp_path / "hf-dir-without-one"))


def test_missing_binary_names_the_make_target(tmp_path) -> None:
    with pytest.raises(ServeError, match="make llama-server"):
        LlamaServer(tmp_path / "nope", tmp_path / "m.gguf", 8, 512, None)


def test_a_server_that_cannot_start_fails_with_its_log_and_leaves_nothing(tmp_path) -> None:
    server = LlamaServer(Path("/bin/false"), tmp_path / "m.gguf", 8, 512, 1)
    args = server.args
    assert args[args.index("--parallel") + 1] == "8" and args[args.index("--ctx-size") + 1] == str(8 * 512)
    with pytest.raises(ServeError, match="llama-server .* did not become ready"):
        server.start()
    assert server.proc is None and not _process_group(server.pids.get("llama-server"))
