"""The shape of the process rooms' code: parts held, not inherited, and no circle of imports.

A class of worker/ (or frontend/) with more than one base is a partial class: each base
reads state the others define, so no file holds one idea. The parts are objects the owner
builds with what they need instead (the way scheduler/ works). Bases that only say what a
class is (a Protocol, an exception, a msgspec Struct, an enum, ...) are not parts.
Within one folder no module reaches, through its imports (type-only ones too), a module that
imports it: a folder whose modules import each other is one module in several files."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_layering import PACKAGE, _cycle, _import_targets, _package_of

# Bases that say what a class is, not a part it is made of.
KIND_BASES = {
    "Protocol", "Generic", "NamedTuple", "TypedDict", "Exception", "BaseException", "ValueError", "KeyError",
    "RuntimeError", "TypeError", "OSError", "LookupError", "Struct", "Enum", "IntEnum", "StrEnum", "Flag", "IntFlag",
    "Choice", "str", "int", "ABC",
}  # fmt: skip

# The folders whose classes hold their parts. frontend/ joins once its mixins are parts too
# (issue 38: Frontend(ClientIntake, ClientConnections, SchedulerSide)).
COMPOSED_FOLDERS = ("worker", "frontend")


def _base_name(node: ast.expr) -> str:
    """``Protocol`` for ``Protocol``, ``typing.Protocol`` and ``Generic[T]`` alike."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return ast.unparse(node)


def classes_with_parts(folder: Path) -> dict[str, list[str]]:
    """``module.Class`` -> its bases, for every class under ``folder`` with more than one base
    that is not a kind (:data:`KIND_BASES`)."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [_base_name(base) for base in node.bases]
                parts = [base for base in bases if base not in KIND_BASES]
                if len(parts) > 1:
                    found[f"{path.relative_to(folder).as_posix()}:{node.name}"] = bases
    return found


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level, ``TYPE_CHECKING`` ones included: a module
    that names another's types depends on its ideas as much as one that calls it."""
    package = _package_of(path)
    return {
        name
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in _import_targets(node, package, submodules=True)
    }


def import_graph(folder: Path) -> dict[str, set[str]]:
    """The modules of ``folder`` (its subfolders' too) -> those of them each imports. A
    package's ``__init__`` is left out: importing a submodule runs it, which is no dependency."""
    modules = {_module_name(path): path for path in sorted(folder.rglob("*.py")) if path.name != "__init__.py"}
    return {
        name: {target for target in _all_imports(path) if target in modules and target != name}
        for name, path in modules.items()
    }


def _folders() -> list[str]:
    return sorted(path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.glob("*.py")))


@pytest.mark.parametrize("folder", COMPOSED_FOLDERS)
def test_no_class_inherits_its_parts(folder: str) -> None:
    assert classes_with_parts(PACKAGE / folder) == {}


# Folders with a circle still (issue 38), each to join once it is broken.
CIRCLES_LEFT: dict[str, str] = {}
CIRCLE_FREE_FOLDERS = [folder for folder in _folders() if folder not in CIRCLES_LEFT]


@pytest.mark.parametrize("folder", CIRCLE_FREE_FOLDERS)
def test_no_circle_of_imports_inside_a_folder(folder: str) -> None:
    graph = import_graph(PACKAGE / folder)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


# The modules of a step: they reach a model through CausalLM (worker/models/interface.py) only.
STEP_MODULES = (
    "model_runner.py", "decode_step.py", "ragged_step.py", "logprob_steps.py", "speculative_verify.py",
    "grammar_steps.py", "draft_model.py", "step_parts.py",
)  # fmt: skip


def model_members_used(path: Path) -> set[str]:
    """The attributes ``path`` reads off anything called ``model`` (``model.x``, ``self.model.x``)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "model":
                used.add(node.attr)
    return used


def test_the_step_reaches_a_model_only_through_its_interface() -> None:
    """What the runner and its parts use of a model is what CausalLM declares, so a new
    architecture that implements the interface runs through every step path."""
    from conveyor.worker.models.interface import CausalLM

    offered = {name for name in dir(CausalLM) if not name.startswith("_") or name == "__call__"}
    offered |= set(CausalLM.__annotations__)
    used = {name: model_members_used(PACKAGE / "worker" / name) for name in STEP_MODULES}
    assert "compute_logits" in used["decode_step.py"]  # (the walk sees them)
    assert {name: sorted(members - offered) for name, members in used.items() if members - offered} == {}


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The checkers themselves: a partial class is found and kinds are not (on a folder made
    for them); an import under TYPE_CHECKING is an edge, so a circle through it is found."""
    room = PACKAGE / "worker"
    (tmp_path / "parts.py").write_text(
        "import enum, typing\n"
        "class A: ...\n"
        "class B: ...\n"
        "class Both(A, B): ...\n"
        "class Kind(str, enum.Enum): ...\n"
        "class Shape(typing.Protocol, typing.Generic[int]): ...\n"
    )
    assert classes_with_parts(tmp_path) == {"parts.py:Both": ["A", "B"]}
    worker = import_graph(room)
    assert "conveyor.worker.grammar_rows" in worker["conveyor.worker.request_state"]  # (under TYPE_CHECKING)
    assert _cycle({**worker, "conveyor.worker.grammar_rows": {"conveyor.worker.request_state"}}) is not None
