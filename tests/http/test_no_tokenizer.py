"""The HTTP process never tokenizes (issue 38 item 3, issue 43 item 1): what it needs of the
tokenizer (``/tokenize``, ``/detokenize``, ``echo``, ``return_token_ids``, prompt
log-probabilities, continuous usage) is asked of the frontend (``tokenize`` / ``detokenize``,
tests/frontend/test_token_messages.py), whose bounds apply before any work. Checked on the
source: no module of conveyor.http imports what encodes, and the one that holds a tokenizer
(for ``/tokenizer_info``) calls nothing on it that encodes or decodes."""

from __future__ import annotations

import ast
from pathlib import Path

HTTP = Path(__file__).resolve().parents[2] / "src" / "conveyor" / "http"
ENCODERS = {
    "conveyor.frontend.inputs",
    "conveyor.frontend.processor",
    "conveyor.frontend.detokenizer",
    "tokenizers",
    "transformers",
}
ENCODING_CALLS = {"encode", "decode", "decode_one", "apply_chat_template", "convert_ids_to_tokens", "render_chat"}


def _modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_http_module_imports_an_encoder() -> None:
    for path in HTTP.glob("*.py"):
        imported = _modules(ast.parse(path.read_text(encoding="utf-8")))
        assert not imported & ENCODERS, (path.name, imported & ENCODERS)


def test_the_tokenizer_held_for_tokenizer_info_never_encodes() -> None:
    """No encoding call on anything named a tokenizer in conveyor.http (``Tokens.decode`` asks the frontend)."""
    calls = []
    for path in HTTP.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ENCODING_CALLS:
                calls.append((path.name, ast.unparse(node.func)))
    assert ("generation.py", "tokens.decode") in calls  # (the check sees the calls it must)
    assert not [c for c in calls if "tokenizer" in c[1]], calls
