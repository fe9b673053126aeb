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


def _package_of(path: Path) -> str:
    """The package a relative import in ``path`` starts from."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _import_targets(node: ast.Import | ast.ImportFrom, package: str, *, submodules: bool) -> list[str]:
    """The absolute module names one import statement names (relative ones resolved against
    ``package``). ``submodules``: ``from pkg import name`` names ``pkg.name`` alone when that is
    a module of this package (``from conveyor import profiling`` imports the subpackage, not
    the facade), else ``pkg``; without it, both ``pkg`` and every ``pkg.name``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    names = [f"{base}.{alias.name}" for alias in node.names]
    if not submodules:
        return [base, *names]
    return [name for name in names if _module_path(name) is not None] or [base]


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved), anywhere in it."""
    package = _package_of(path)
    return {
        name
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in _import_targets(node, package, submodules=False)
    }


def _runtime_imports(path: Path) -> set[str]:
    """The modules ``path`` imports when it runs: every import, at module level or inside a
    function, except those under ``if TYPE_CHECKING:`` (annotations only)."""
    package = _package_of(path)
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(_import_targets(node, package, submodules=True))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return names


def _module_path(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] != PACKAGE.name:
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _floor(module: str) -> str:
    """The folder (``conveyor.<name>``) a module stands in; the facade and top-level modules are their own."""
    return ".".join(module.split(".")[:2])


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph.setdefault(_floor(module), set())
        for name in _runtime_imports(path):
            if name.split(".")[0] == PACKAGE.name and _floor(name) != _floor(module):
                graph[_floor(module)].add(_floor(name))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph``, as the nodes along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := walk(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)) is not None:
            return found
    return None


def test_the_folders_import_each_other_without_a_circle() -> None:
    """Floors, not a web: no folder reaches, directly or through others, a folder that imports
    it (function-level imports count; ``TYPE_CHECKING`` ones do not)."""
    graph = _package_graph()
    assert (
        "conveyor.ipc" in graph["conveyor.protocol"] and "conveyor.worker" in graph["conveyor.assembly"]
    )  # edges are seen
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_process_rooms_never_import_the_assembly_above_them() -> None:
    graph = _package_graph()
    for room in (
        "conveyor.runtime",
        "conveyor.frontend",
        "conveyor.scheduler",
        "conveyor.worker",
        "conveyor.ipc",
        "conveyor.protocol",
    ):
        assert not graph[room] & {"conveyor.assembly", "conveyor.engine", "conveyor.cli", "conveyor.http"}, (
            room,
            graph[room],
        )


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
    assert "conveyor.assembly.build" in _imported_modules(PACKAGE / "engine" / "engine.py")
    assert "conveyor.assembly.supervisor.Server" in _imported_modules(PACKAGE / "cli" / "serve.py")
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

engine = Engine("demo", num_kv_blocks=32, threads=1, device="cpu", max_model_len=64)  # built here
[result] = engine.generate(["Hello"], max_tokens=3, temperature=0.0, ignore_eos=True, progress=False)
assert len(result.token_ids) == 3, result
"""


def test_serving_never_needs_transformers(tmp_path) -> None:
    """Every process's entry, the CLI that serves, and the engine building the demo model
    and generating from it, with transformers unimportable."""
    run_without(
        ("transformers",),
        SERVES_WITHOUT_TRANSFORMERS,
        env={**os.environ, "CONVEYOR_CACHE": str(tmp_path / "cache")},
        timeout=240,
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


# The one module allowed past the bound: the ring's layout, protocol and both ends read best together.
LONG_MODULES = {"src/conveyor/ipc/shm_ring.py"}
# 500 lines before the tree was ruff-formatted; the formatter lays a long call out one argument
# per line, so the same code takes 10-20 % more lines: 600 holds the same amount of code.
MAX_MODULE_LINES = 600


def test_no_module_is_over_the_line_bound() -> None:
    """Every Python module of the product, its tools, benchmarks and tests stays under the bound
    (a longer one holds more than one responsibility: split it by topic)."""
    root = PACKAGE.parent.parent
    long = {
        path.relative_to(root).as_posix(): lines
        for folder in ("src", "bench", "tests")
        for path in sorted((root / folder).rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) >= MAX_MODULE_LINES
    }
    assert set(long) == LONG_MODULES, long
