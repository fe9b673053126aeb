"""What every bin/ command runs: its conveyor.cli module's main, under the right interpreter.

``make install PYTHON=/path/to/venv/python`` installs conveyor into that interpreter and
records its path in ``.conveyor-python`` at the repository root (git-ignored). A command
started by another interpreter, in which conveyor is not importable (``bin/serve`` runs
``#!/usr/bin/env python3``), replaces itself with the recorded one, same arguments. An
interpreter that has conveyor runs the command itself, so ``python3 bin/serve`` keeps the
interpreter it was given. Standard library only: it runs where conveyor is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

RECORDED_INTERPRETER = Path(__file__).resolve().parent.parent / ".conveyor-python"


def launch(module: str) -> None:
    """Run ``module``'s ``main()`` and exit with its status."""
    if importlib.util.find_spec("conveyor") is None:
        _run_under_installed_interpreter()
    try:
        main = importlib.import_module(module).main
    except ImportError as exc:
        sys.exit(f"conveyor cannot be imported ({exc}); run `make install` in the repository")
    sys.exit(main())


def _run_under_installed_interpreter() -> None:
    """Re-execute this command with the interpreter ``make install`` recorded; exit with a
    clear message when there is none to go to. Never returns."""
    try:
        recorded = RECORDED_INTERPRETER.read_text(encoding="utf-8").strip()
    except OSError:
        recorded = ""
    # Paths compared unresolved: a venv's python is a symlink to the base interpreter, and only
    # the path it was started by selects the venv. After the exec, sys.executable is recorded.
    if recorded and os.path.abspath(recorded) != os.path.abspath(sys.executable) and os.access(recorded, os.X_OK):
        os.execv(recorded, [recorded, sys.argv[0], *sys.argv[1:]])
    where = f"; {recorded} (recorded by make install) cannot run it either" if recorded else ""
    sys.exit(
        f"conveyor is not installed for {sys.executable}{where}; "
        "run `make install` (or `make install PYTHON=/path/to/python`) in the repository first"
    )
