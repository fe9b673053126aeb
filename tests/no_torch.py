"""Run a snippet in a fresh interpreter where importing torch fails, for the processes that
must work without it (frontend, HTTP face): a stricter proof than checking sys.modules, since
an optional ``import torch`` that would succeed here is caught too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this process ({name})")
            return None

    sys.meta_path.insert(0, NoTorch())
    """
)

_NEITHER_LOADED = textwrap.dedent(
    """
    assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
    assert "transformers" not in sys.modules
    print("ok")
    """
)


def run_without_torch(body: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> None:
    """Run ``body`` with torch blocked, then check that neither torch nor transformers got
    loaded; fails the test with the child's stderr if anything did not hold."""
    script = _BLOCK_TORCH + textwrap.dedent(body) + _NEITHER_LOADED
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
