"""bench/gpu_checks.sh, the first GPU window's script, checked here first.

The dry run (``--cpu``) runs every stage of both windows with CPU flags on a tiny checkpoint:
each must pass, or be skipped for a stated reason (a stage whose command is another's at
another size); ``$OUT`` must hold exactly the packed results and the summary; the smoke
stage's figure comes first. The GPU plan itself is checked without running it: the first
window's order and that its limits fit the deadline, compiled HF in window 2. A stage that
would cross the deadline is skipped and said; a missing module stops the run at the
preflight, naming it and the wheel to carry.

The dry run is the cost of this module (~70 CPU seconds: each stage starts its own
processes); it runs once, shared by the tests that read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "bench"))  # last: bench/ holds modules named like common ones

import gpu_checks  # noqa: E402
import gpu_stages  # noqa: E402

FIRST = ["checkpoint", "smoke", "conveyor_b128", "hf", "decode_step", "gpu_tests"]


def gpu_checks_sh(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **(env or {})}
    cmd = ["bash", str(REPO / "bench" / "gpu_checks.sh"), "--cpu", "--work", str(tmp_path / "work"), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    return proc, out


def packed(out: Path) -> dict[str, str]:
    """The tgz's files (name under gpu-results/ -> text), after checking $OUT holds only it and the summary."""
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tgz", "summary.txt"]
    with tarfile.open(out / "gpu-results.tgz") as tar:
        return {
            m.name.removeprefix("gpu-results/"): tar.extractfile(m).read().decode(errors="replace")
            for m in tar.getmembers()
            if m.isfile()
        }


def stage_lines(summary: str) -> dict[str, str]:
    lines = summary.split("stages:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return {line.split()[0]: line.split(None, 1)[1] for line in lines}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(Its time counts against the first test's timeout: see that test's mark.)"""
    tmp = tmp_path_factory.mktemp("dry")
    proc, out = gpu_checks_sh(tmp)
    return proc, out, packed(out)


@pytest.mark.timeout(900)  # ~60 s on two idle cores; a shared, loaded machine takes several times that
def test_the_dry_run_runs_every_stage_or_says_why_not(dry_run):
    proc, out, files = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert files["summary.txt"] == summary
    stages = stage_lines(summary)
    plan = [s.name for s in gpu_stages.stages(True, Path("r"), Path("c"), tmp_work(out))]
    assert list(stages) == ["preflight", *plan]  # both windows, the plan's order
    for name, status in stages.items():
        skipped = status.startswith(gpu_checks.CPU_SKIPPED)
        assert status.startswith("passed") or skipped, (name, status)
        if skipped:  # a reason: the stage or the suite's tests that check the same command
            assert len(status.removeprefix(gpu_checks.CPU_SKIPPED).strip()) > 20, status
        else:
            assert name == "preflight" or f"{name}.log" in files
    assert all(stages[name].startswith("passed") for name in FIRST)  # the first window's stages all run
    assert sum(1 for s in stages.values() if s.startswith("passed")) >= 12
    assert "zmq " in files["device.txt"] and "llguidance " in files["device.txt"] and "commit " in files["device.txt"]


def tmp_work(out: Path) -> Path:
    return out.parent / "work"


def test_the_smoke_figure_comes_first_and_conveyor_is_timed_twice(dry_run):
    _, out, files = dry_run
    figures = (out / "summary.txt").read_text().split("\n\n", 2)[2]
    assert figures.startswith("smoke (cpu float32)"), figures[:300]
    smoke = json.loads(files["smoke.json"])
    assert [r["batch"] for r in smoke["decode_step"]] == [1, 4] and smoke["greedy"]["graphs_equal_eager"] is True
    b128 = json.loads(files["conveyor_b128.json"])
    assert b128["settings"]["warmup"] == "workload" and b128["settings"]["timed_runs"] == 2
    windows = b128["systems"]["conveyor"]["extra"]["timed_runs"]
    assert len(windows) == 2 and all(w["output_tok_s"] > 0 for w in windows)
    # The reported figure is the second window's; no compile count on a CPU (nothing compiles).
    assert b128["systems"]["conveyor"]["runs"][-1]["output_tok_s"] == windows[1]["output_tok_s"]
    assert all(w["triton_compiles"] is None for w in windows)
    assert "Triton compiles in each: n/a, n/a" in figures


def test_the_gpu_tests_collect_without_the_http_clients(dry_run):
    """Only the gpu-marked files, collected with openai and jsonschema unimportable, as on the device."""
    _, _, files = dry_run
    log = files["gpu_tests.log"]
    names = gpu_stages.gpu_test_files()
    assert "tests/worker/test_cuda_graphs.py" in names and gpu_stages.SPEC_TESTS not in names
    assert not any(n.startswith("tests/kernels/") for n in names)
    assert all(n in log.splitlines()[0] for n in names)
    assert "error" not in log.lower().split("$", 1)[1].split("\n", 1)[1]


def test_the_first_window_fits_its_deadline_and_compiled_hf_waits_for_a_later_one(tmp_path):
    plan = gpu_stages.stages(False, tmp_path, tmp_path, tmp_path)
    args = gpu_checks.parse_args(["--out", str(tmp_path)])
    first, notes = gpu_checks.select(plan, args)
    assert [s.name for s in first][: len(FIRST)] == FIRST
    assert gpu_checks.PREFLIGHT_S + sum(s.limit_s for s in first[: len(FIRST)]) <= gpu_checks.GPU_DEADLINE_S
    assert next(s for s in first if s.name == "smoke").limit_s <= 60
    assert not any(s.name.startswith("hf_compiled") for s in first) and "hf_compiled_b1" in notes[0]
    second, _ = gpu_checks.select(plan, gpu_checks.parse_args(["--window", "2", "--out", str(tmp_path)]))
    assert [s.name for s in second] == ["checkpoint", "hf_compiled_b1", "hf_compiled_b8"]
    assert all(s.limit_s >= 180 for s in second[1:])  # a cold torch.compile of 16 layers takes minutes
    rerun, notes = gpu_checks.select(
        plan, gpu_checks.parse_args(["--stages", "hf_compiled_b1,checkpoint", "--out", str(tmp_path)])
    )
    assert [s.name for s in rerun] == ["checkpoint", "hf_compiled_b1"] and "gpu_tests" in notes[0]
    bench = next(s for s in first if s.name == "conveyor_b128").command
    assert bench[bench.index("--warmup") + 1] == "workload" and bench[bench.index("--timed-runs") + 1] == "2"


def test_a_stage_that_would_cross_the_deadline_is_skipped_and_said(tmp_path, monkeypatch):
    def preflight(cpu, results, env):
        (results / "device.txt").write_text("commit test\n")
        return []

    monkeypatch.setattr(gpu_checks, "preflight", preflight)
    out = tmp_path / "out"
    assert gpu_checks.main(["--cpu", "--deadline", "5", "--work", str(tmp_path / "work"), "--out", str(out)]) == 1
    stages = stage_lines((out / "summary.txt").read_text())
    crossing = [name for name, status in stages.items() if "would cross the deadline" in status]
    assert crossing[:3] == ["checkpoint", "smoke", "conveyor_b128"] and "hf_compiled_b1" in crossing
    assert stages["preflight"].startswith("passed")
    assert set(packed(out)) == {"device.txt", "summary.txt"}


def test_a_missing_module_stops_the_run_at_the_preflight(tmp_path):
    shadow = tmp_path / "shadow" / "msgspec"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: no msgspec wheel carried')\n")
    env = {"PYTHONPATH": f"{shadow.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc, out = gpu_checks_sh(tmp_path, env=env)
    assert proc.returncode == 2
    assert "PREFLIGHT FAILED" in proc.stderr and "simulated: no msgspec wheel carried" in proc.stderr
    assert "make gpu-wheels" in proc.stderr and "msgspec>=" in proc.stderr
    stages = stage_lines((out / "summary.txt").read_text())
    assert stages["preflight"] == "failed" and stages["checkpoint"] == "not reached"
    assert set(packed(out)) == {"device.txt", "summary.txt"}
