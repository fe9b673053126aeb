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
