"""The package's floors: the library never stands on the CLI, the product never on its tools,
and nothing that serves needs transformers (an extra of the tools and the tests)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import conveyor
from tests.no_torch import run_without

PACKAGE = Path(conveyor.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved), anywhere in it."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _importers_of(prefix: str, *, outside: str | None = None) -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if outside is not None and rel.startswith(outside):
            continue
        hits = sorted(n for n in _imported_modules(path) if n == prefix or n.startswith(prefix + "."))
        if hits:
            found[rel] = hits
    return found


def test_the_walk_sees_imports_of_every_form() -> None:
    """The checker itself: absolute, from- and relative imports are all read."""
    assert "conveyor.runtime.build" in _imported_modules(PACKAGE / "engine" / "engine.py")
    assert "conveyor.runtime.supervisor.Server" in _imported_modules(PACKAGE / "cli" / "serve.py")
    assert "conveyor.cli.server_address" in _imported_modules(PACKAGE / "cli" / "client.py")


def test_nothing_outside_the_cli_imports_it() -> None:
    assert _importers_of("conveyor.cli", outside="conveyor/cli/") == {}


def test_the_product_never_imports_its_tools() -> None:
    assert _importers_of("conveyor_tools") == {}


def test_importing_the_engine_loads_neither_the_cli_nor_aiohttp() -> None:
    code = (
        "import sys, conveyor.engine\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp' or m.startswith('conveyor.cli'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


SERVES_WITHOUT_TRANSFORMERS = """
import conveyor.cli.serve, conveyor.cli.client, conveyor.cli.profile, conveyor.cli.keygen
import conveyor.frontend.main, conveyor.scheduler.main, conveyor.worker.main, conveyor.http.main
import conveyor.worker.model_runner
from conveyor import Engine

engine = Engine(num_kv_blocks=32, threads=1, device="cpu", max_model_len=64)  # the demo model, built here
[result] = engine.generate(["Hello"], max_tokens=3, temperature=0.0, ignore_eos=True, progress=False)
assert len(result.token_ids) == 3, result
"""


def test_serving_never_needs_transformers(tmp_path) -> None:
    """Every process's entry, the CLI that serves, and the engine building the demo model
    and generating from it, with transformers unimportable."""
    run_without(
        ("transformers",), SERVES_WITHOUT_TRANSFORMERS, env={**os.environ, "CONVEYOR_CACHE": str(tmp_path / "cache")}, timeout=240
    )


def test_a_checkpoint_that_needs_conversion_says_how_without_transformers(tmp_path) -> None:
    """Without the extra, a missing tokenizer.json and the converter both name the install."""
    (tmp_path / "tokenizer_config.json").write_text("{}")
    body = f"""
import contextlib, io
import pytest
from conveyor.cli import convert_tokenizer
from conveyor.frontend.tokenizer import Tokenizer

with pytest.raises(FileNotFoundError, match=r'bin/convert-tokenizer.*pip install "conveyor\\[convert\\]"'):
    Tokenizer.from_dir({str(tmp_path)!r})
err = io.StringIO()
with contextlib.redirect_stderr(err):
    assert convert_tokenizer.main([{str(tmp_path)!r}]) == 1
assert 'pip install "conveyor[convert]"' in err.getvalue(), err.getvalue()
"""
    run_without(("transformers",), body)
