"""What `make serve` / `make test` install, and when: the install step runs only when
pyproject.toml or the interpreter changed (a restart of `make serve` costs no pip run), a
fresh clone installs everything for the tests, and serving installs no Triton of its own.
The Makefile runs in a copy of the repository's with pip replaced by an echo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PIP_RAN = "PIP-RAN"


@pytest.fixture
def checkout(tmp_path) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def pip_runs(checkout: Path, target: str, python: str = sys.executable) -> list[str]:
    """The pip commands ``make target`` ran in ``checkout`` (each echoed, not run)."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    result = subprocess.run(
        ["make", "--no-print-directory", target, f"PYTHON={python}", f"PIP=echo {PIP_RAN}"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith(PIP_RAN)]


def test_the_install_runs_only_when_something_changed(checkout, tmp_path) -> None:
    assert pip_runs(checkout, "install") == [f"{PIP_RAN} install -e .[test,bench]"]  # a fresh clone: everything
    assert (checkout / ".conveyor-python").read_text().strip() == sys.executable
    assert pip_runs(checkout, "install") == []
    assert pip_runs(checkout, "install-serve") == []  # `make serve` after `make test`: nothing to do
    earlier = time.time() - 10  # pyproject.toml edited after the installs
    for stamp in checkout.glob(".conveyor-*"):
        os.utime(stamp, (earlier, earlier))
    assert pip_runs(checkout, "install-serve") == [f"{PIP_RAN} install -e .[convert]"]
    assert pip_runs(checkout, "install-serve") == []
    assert pip_runs(checkout, "install") == [f"{PIP_RAN} install -e .[test,bench]"]
    venv = tmp_path / "venv"  # another interpreter
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    assert pip_runs(checkout, "install-serve", python) == [f"{PIP_RAN} install -e .[convert]"]
    assert (checkout / ".conveyor-python").read_text().strip() == python
    assert pip_runs(checkout, "install-serve", python) == []


def test_serving_depends_on_no_triton_the_tests_do() -> None:
    """A CPU torch has no use for Triton and does not require it; a CUDA torch wheel requires
    its own (torch's metadata: triton; platform_system == "Linux" and platform_machine ==
    "x86_64"), so a GPU install still gets it. The CPU tests run the kernels in Triton's
    interpreter: the test extra has it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert [d for d in project["optional-dependencies"]["test"] if d.startswith("triton")]
