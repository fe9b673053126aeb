"""bench/gpu_checks.sh's dry mode (--cpu): what a GPU window relies on, checked here first.

The device tool brings back at most 8 files from $OUT, so every run must leave exactly the
packed results and the summary there, after whichever stage it stopped; a stage that would
cross the deadline must be skipped and say so; a missing module must stop the run at the
preflight with a non-zero status naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def gpu_checks(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **(env or {})}
    cmd = ["bash", str(REPO / "bench" / "gpu_checks.sh"), "--cpu", "--work", str(tmp_path / "work"), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    return proc, out


def packed(out: Path) -> dict[str, str]:
    """The tgz's files (name under gpu-results/ -> text), after checking $OUT holds only it and the summary."""
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tgz", "summary.txt"]
    with tarfile.open(out / "gpu-results.tgz") as tar:
        return {
            m.name.removeprefix("gpu-results/"): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
            if m.isfile()
        }


def test_selected_stages_run_and_everything_is_packed(tmp_path):
    proc, out = gpu_checks(tmp_path, "--stages", "checkpoint,hf_compiled_b1", "--deadline", "100")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = packed(out)
    summary = (out / "summary.txt").read_text()
    assert files["summary.txt"] == summary
    for stage in ("checkpoint", "hf_compiled_b1"):
        assert f"{stage}.log" in files
        assert any(line.split()[:2] == [stage, "passed"] for line in summary.splitlines()), summary
    assert "stages not selected: gpu_tests, conveyor_b128" in summary
    assert "zmq " in files["device.txt"] and "commit " in files["device.txt"]
    assert "hf_compiled_b1.json" in files
    # The figure: compiled HF's per-token latency at batch 1.
    assert "hf_compiled_b1: hf-compiled batch 1:" in summary and "per-token" in summary


def test_a_stage_that_would_cross_the_deadline_is_skipped_and_said(tmp_path):
    proc, out = gpu_checks(tmp_path, "--deadline", "15")  # under every stage's limit
    assert proc.returncode == 1
    summary = (out / "summary.txt").read_text()
    stages = [line.split()[0] for line in summary.splitlines() if "would cross the deadline" in line]
    assert stages[:3] == ["gpu_tests", "checkpoint", "conveyor_b128"] and "static" in stages
    assert "preflight        passed" in summary
    assert set(packed(out)) == {"device.txt", "summary.txt"}


def test_a_missing_module_stops_the_run_at_the_preflight(tmp_path):
    shadow = tmp_path / "shadow" / "msgspec"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: no msgspec wheel carried')\n")
    env = {"PYTHONPATH": f"{shadow.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc, out = gpu_checks(tmp_path, env=env)
    assert proc.returncode == 2
    assert "PREFLIGHT FAILED" in proc.stderr and "simulated: no msgspec wheel carried" in proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "preflight        failed" in summary and "gpu_tests        not reached" in summary
    assert set(packed(out)) == {"device.txt", "summary.txt"}
