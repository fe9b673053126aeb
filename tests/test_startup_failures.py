"""A child process whose start-up fails (conveyor.runtime.process.run_process): the reason goes
to bin/serve, which prints it as its one line; the child adds no traceback for an expected
mistake (a StartupError, an address in use) unless $CONVEYOR_DEBUG is set, and keeps the
traceback of anything unexpected."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import sys, zmq
    from conveyor.ipc import codec, transport
    from conveyor.runtime.model_source import StartupError
    from conveyor.runtime.process import run_process

    address = sys.argv[1]
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    errors = {"startup": StartupError("--flag x: what to do"),
              "in-use": transport.AddressInUse("tcp://h:1 is already in use"), "bug": RuntimeError("unexpected")}

    def start(ctx):
        raise errors[sys.argv[2]]

    run_process("child", address, start)
    print(codec.decode(pull.recv()).reason)
    """
)


def run_child(tmp_path, kind: str, debug: bool = False) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_DEBUG"}
    if debug:
        env["CONVEYOR_DEBUG"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, f"ipc://{tmp_path}/control", kind],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize("kind", ["startup", "in-use"])
def test_an_expected_failure_is_reported_without_a_traceback(tmp_path, kind) -> None:
    reason, err = run_child(tmp_path, kind)
    assert reason.startswith("child: ") and ("--flag x" in reason or "in use" in reason)
    assert err == "", err


def test_debug_and_unexpected_failures_keep_the_traceback(tmp_path) -> None:
    assert "Traceback" in run_child(tmp_path, "startup", debug=True)[1]
    reason, err = run_child(tmp_path, "bug")
    assert reason == "child: unexpected" and "Traceback" in err


def test_a_reasoning_parser_needs_the_think_tokens(tmp_path) -> None:
    """bin/serve's preflight refuses --reasoning-parser for a tokenizer without <think> and
    </think> tokens (the demo's), naming the flag; one with them added (Qwen3's are) passes."""
    import json
    from pathlib import Path

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    import conveyor.checkpoints.demo as demo
    from conveyor.assembly.preflight import check_think_tokens
    from conveyor.runtime.model_source import StartupError

    plain = Path(demo.__file__).parent / "tokenizer.json"
    with pytest.raises(StartupError, match=r"--reasoning-parser qwen3: .*no <think> and no </think> token"):
        check_think_tokens(plain, "qwen3")
    backend = Backend.from_file(str(plain))
    backend.add_tokens([AddedToken("</think>", special=False, normalized=False)])
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(StartupError, match=r"no <think> token"):
        check_think_tokens(tmp_path / "tokenizer.json", "deepseek_r1")
    backend.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    backend.save(str(tmp_path / "tokenizer.json"))
    check_think_tokens(tmp_path / "tokenizer.json", "qwen3")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"<think>": 0, "</think>": 1}}}))
    check_think_tokens(tmp_path / "tokenizer.json", "qwen3")  # in the vocabulary itself
