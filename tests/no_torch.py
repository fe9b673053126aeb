"""Run a snippet in a fresh interpreter where importing some packages fails: torch, for the
processes that must work without it (frontend, HTTP face); transformers, for everything that
serves (it is an extra of the tools and the tests only). A stricter proof than checking
sys.modules, since an optional import that would succeed here is caught too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = {blocked!r}

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked in this process")
            return None

    sys.meta_path.insert(0, Blocked())
    """
)

_NONE_LOADED = textwrap.dedent(
    """
    assert not [m for m in sys.modules if m.split(".")[0] in {unloaded!r}]
    print("ok")
    """
)


def run_without(
    blocked: tuple[str, ...], body: str, *, unloaded: tuple[str, ...] = (), env=None, timeout: float = 120
) -> None:
    """Run ``body`` with the packages ``blocked`` unimportable, then check that none of them
    nor of ``unloaded`` got loaded; fails the test with the child's stderr if anything did not hold."""
    names = set(blocked) | set(unloaded)
    script = _BLOCKER.format(blocked=set(blocked)) + textwrap.dedent(body) + _NONE_LOADED.format(unloaded=names)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def run_without_torch(body: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> None:
    """Run ``body`` with torch blocked, then check that neither torch nor transformers got loaded."""
    run_without(("torch",), body, unloaded=("transformers",), env=env, timeout=timeout)
