"""examples/engine_offline.py runs as a user would run it (a subprocess, the demo model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_offline.py"


def test_the_offline_example_runs():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", "demo", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("step 1: 1 requests") and "admitted 1" in lines[0]
    assert any(line.startswith("fox: length, 4 tokens") for line in lines)
    continued = next(line for line in lines if line.startswith("fox, continued:"))
    assert not continued.startswith("fox, continued: 0 of"), "the continuation reused no KV"
    assert sum(line.lstrip().startswith("length   4 tokens") for line in lines) == 12  # every prompt of generate()
