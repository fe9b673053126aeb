"""bin/serve with a user's mistake: one line naming the flag and what to do, a non-zero
exit, no traceback (``--debug`` shows one), and for the mistakes found without the model,
the answer before any process starts (no child ever logs a line) and within seconds."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e.serve_harness import SERVE

# Far below a model load on a loaded machine; what proves "before the model" is that no child
# process wrote a line (every child's log line carries "name[pid]").
QUICK_S = 60
CHILDREN = ("frontend[", "worker[", "scheduler[", "http[")


def serve(*args: str, timeout: float = 180) -> tuple[int, str, str, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SERVE), *args], capture_output=True, text=True, env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def assert_one_line_before_start(args: list[str], *needles: str) -> str:
    code, out, err, took = serve(*args)
    assert code != 0, err
    assert out == "", out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and not any(child in err for child in CHILDREN), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert took < QUICK_S, f"{took:.1f} s"
    return lines[0]


@pytest.fixture
def listening():
    """A TCP port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_in_use(tiny_checkpoint, listening) -> None:
    line = assert_one_line_before_start(["--model", str(tiny_checkpoint), "--port", str(listening)], "--port", "in use")
    assert str(listening) in line


def test_http_port_in_use(tiny_checkpoint, listening, tmp_path) -> None:
    args = ["--model", str(tiny_checkpoint), "--host", f"ipc://{tmp_path}/c", "--http-port", str(listening)]
    assert_one_line_before_start(args, "--http-port", "in use")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with a GPU has CUDA")
def test_device_cuda_without_a_gpu(tiny_checkpoint, tmp_path) -> None:
    args = ["--model", str(tiny_checkpoint), "--host", f"ipc://{tmp_path}/c", "--device", "cuda"]
    assert_one_line_before_start(args, "--device cuda", "--device cpu")


def test_lora_rank_over_the_limit(tiny_checkpoint, tmp_path) -> None:
    adapter = tmp_path / "big"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 64, "target_modules": ["q_proj"]})
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"")  # never read: the rank refuses it first
    args = [
        "--model",
        str(tiny_checkpoint),
        "--host",
        f"ipc://{tmp_path}/c",
        "--lora-modules",
        f"big={adapter}",
        "--max-lora-rank",
        "16",
    ]
    assert_one_line_before_start(args, "--lora-modules big=", "rank 64", "--max-lora-rank")


def test_missing_tokenizer_json(tiny_checkpoint, tmp_path) -> None:
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_checkpoint, model)
    (model / "tokenizer.json").unlink()
    assert_one_line_before_start(
        ["--model", str(model), "--host", f"ipc://{tmp_path}/c"], "--model", "bin/convert-tokenizer"
    )


def test_speculative_tokens_without_a_method(tiny_checkpoint, tmp_path) -> None:
    args = ["--model", str(tiny_checkpoint), "--host", f"ipc://{tmp_path}/c", "--num-speculative-tokens", "3"]
    assert_one_line_before_start(args, "--num-speculative-tokens", "--speculative-method")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size", "3"], "--block-size"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks"),
    ],
)
def test_bad_values_name_their_flag(tiny_checkpoint, tmp_path, flags, named) -> None:
    line = assert_one_line_before_start(
        ["--model", str(tiny_checkpoint), "--host", f"ipc://{tmp_path}/c", *flags], named
    )
    assert "_" not in line.split(":", 1)[1].split()[0], line  # the flag, not the config field


def test_debug_shows_the_traceback(tiny_checkpoint, listening) -> None:
    code, _, err, _ = serve("--model", str(tiny_checkpoint), "--port", str(listening), "--debug")
    assert code != 0 and "Traceback" in err and err.strip().splitlines()[-1].startswith("conveyor: --port"), err


def test_unreadable_tls_files(tiny_checkpoint, tmp_path) -> None:
    (tmp_path / "cert.pem").write_text("not a certificate")
    args = [
        "--model",
        str(tiny_checkpoint),
        "--host",
        f"ipc://{tmp_path}/c",
        "--http-port",
        "0",
        "--ssl-certfile",
        str(tmp_path / "cert.pem"),
        "--ssl-keyfile",
        str(tmp_path / "cert.pem"),
    ]
    assert_one_line_before_start(args, "--ssl-certfile")


def assert_one_line_from_the_worker(args: list[str], *needles: str) -> None:
    """A mistake only a started process can find: bin/serve's one line, no traceback."""
    code, out, err, _ = serve(*args)
    assert code != 0 and "ready on" not in out
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "ready (pid" not in line]  # the processes that started say so
    assert len(errors) == 1 and errors[0].startswith("conveyor: startup failed: worker: "), err
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_a_kv_cache_too_small_for_a_block(tiny_checkpoint, tmp_path) -> None:
    """It needs the model's sizes, so the worker finds it; the line names the flags."""
    args = ["--model", str(tiny_checkpoint), "--host", f"ipc://{tmp_path}/c", "--kv-cache-memory", "0.000001"]
    assert_one_line_from_the_worker(args, "--kv-cache-memory", "--num-kv-blocks")


def test_a_checkpoint_without_weights(tiny_checkpoint, tmp_path) -> None:
    model = tmp_path / "no-weights"
    shutil.copytree(tiny_checkpoint, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    assert_one_line_from_the_worker(["--model", str(model), "--host", f"ipc://{tmp_path}/c"], "safetensors", str(model))
