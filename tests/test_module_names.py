"""No module that a tool puts first on ``sys.path`` may share its name with an installed
package or a standard-library module.

``python bench/x.py`` puts ``bench/`` first on ``sys.path`` (and bench/gpu_checks.py inserts it
for its stages), pytest puts the repository root there for ``tests``: a ``bench/kernels.py``
then stands in for the PyPI package ``kernels`` that transformers imports, and every tool that
builds an HF model dies with an ImportError on the day a new transformers starts importing it.
Checked against what is installed here and now, so CI's fresh install of the newest packages
checks the newest names."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The folders whose modules are importable by their bare names when a tool or the suite runs.
SCRIPT_DIRS = [REPO / "bench", REPO / "bin"]


def _bare_modules() -> dict[str, Path]:
    """Module name -> file for every module the repository exposes by a bare name."""
    out = {p.stem: p for d in SCRIPT_DIRS for p in d.glob("*.py")}
    out.update({p.parent.name: p for p in REPO.glob("*/__init__.py")})
    return out


@functools.cache
def _top_level_names() -> dict[str, list[str]]:
    """Installed top-level module name -> the distributions that provide it (read once: it
    walks every installed distribution's file list)."""
    return importlib.metadata.packages_distributions()


def _installed_elsewhere(name: str) -> str | None:
    """Where ``name`` would be found without the repository's folders on the path."""
    if name in sys.stdlib_module_names:
        return "the standard library"
    own = {REPO, *SCRIPT_DIRS}
    path = [p for p in sys.path if p and Path(p).resolve() not in own]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.origin not in (None, "namespace"):  # a module or a regular package
        return spec.origin
    distributions = _top_level_names().get(name)
    return f"the distribution {distributions[0]}" if distributions else None


def test_no_tool_module_shadows_an_installed_package() -> None:
    modules = _bare_modules()
    assert "gpu_checks" in modules and "tests" in modules  # the check sees the folders it guards
    clashes = {name: where for name, file in modules.items() if (where := _installed_elsewhere(name))}
    assert not clashes, f"rename these modules, they shadow installed ones: {clashes}"


def test_the_check_sees_a_shadowing_name() -> None:
    """The check itself can fail: ``json`` (standard library) and ``pytest`` (installed) clash."""
    assert _installed_elsewhere("json") == "the standard library"
    assert _installed_elsewhere("pytest") is not None
    assert _installed_elsewhere("gpu_checks") is None
