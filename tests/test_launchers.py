"""bin/*'s choice of interpreter (bin/_launcher.py).

A copy of bin/ beside a ``.conveyor-python`` of the test's making stands for a checkout that
``make install PYTHON=...`` recorded; a fresh venv without conveyor stands for the
``#!/usr/bin/env python3`` that runs bin/serve from a shell.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A directory holding bin/_launcher.py and bin/serve, and no recorded interpreter yet."""
    (tmp_path / "bin").mkdir()
    for name in ("_launcher.py", "serve"):
        shutil.copy2(REPO / "bin" / name, tmp_path / "bin" / name)
    return tmp_path


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter in which conveyor is not importable."""
    env_dir = tmp_path_factory.mktemp("bare-venv")
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    assert subprocess.run([python, "-c", "import conveyor"], capture_output=True).returncode != 0
    return python


def serve_help(python: str, checkout: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, str(checkout / "bin" / "serve"), "--help"], capture_output=True, text=True, timeout=60
    )


def test_a_command_moves_to_the_interpreter_conveyor_was_installed_with(checkout, bare_python) -> None:
    (checkout / ".conveyor-python").write_text(sys.executable + "\n")
    out = serve_help(bare_python, checkout)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: serve")


def test_without_a_recorded_interpreter_it_says_how_to_install(checkout, bare_python) -> None:
    out = serve_help(bare_python, checkout)
    assert out.returncode != 0
    assert f"conveyor is not installed for {bare_python}" in out.stderr and "make install" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_recorded_interpreter_without_conveyor_is_not_retried(checkout, bare_python) -> None:
    (checkout / ".conveyor-python").write_text(bare_python + "\n")
    out = serve_help(bare_python, checkout)
    assert out.returncode != 0
    assert "cannot run it either" in out.stderr


def test_an_interpreter_with_conveyor_keeps_the_command(checkout) -> None:
    (checkout / ".conveyor-python").write_text(str(checkout / "no-such-python") + "\n")
    out = serve_help(sys.executable, checkout)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: serve")


def test_every_command_runs_a_main_that_exists() -> None:
    """Each bin/ command and each console script of pyproject.toml names a module's main that
    imports (the tools' commands from conveyor_tools, the rest from conveyor), and the two
    lists are the same commands."""
    import importlib
    import re

    import tomllib

    launched = {}
    for path in (REPO / "bin").iterdir():
        if path.name != "_launcher.py":
            [module] = re.findall(r'launch\("([\w.]+)"\)', path.read_text(encoding="utf-8"))
            launched[path.name] = f"{module}:main"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert {f"conveyor-{name}": target for name, target in launched.items()} == scripts
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), target
