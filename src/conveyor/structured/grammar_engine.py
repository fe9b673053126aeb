"""The grammar engine, llguidance, behind an optional import (docs/structured-output.md says
why llguidance and not xgrammar: it imports without torch, so the frontend can compile, and it
builds its lexer lazily, so a new schema costs about a millisecond rather than tens).

The server starts without it; only a constrained request needs it, and then gets
:class:`StructuredOutputUnavailable` (a :class:`ConstraintError`, so a 400 naming the fix).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.structured.constraint import Constraint, ConstraintError

INSTALL_HINT = "pip install 'conveyor[structured]'"
# JSON is generated compact with the usual separators, never with free whitespace: a weak or
# random model given free whitespace can emit it forever, and no client needs it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputUnavailable(ConstraintError):
    """The grammar engine is not installed; structured output is refused, everything else works."""


def load_llguidance() -> ModuleType:
    try:
        import llguidance
    except ImportError as e:
        raise StructuredOutputUnavailable(
            f"structured output needs the llguidance package, which is not installed ({INSTALL_HINT})"
        ) from e
    return llguidance


def available() -> bool:
    try:
        load_llguidance()
    except StructuredOutputUnavailable:
        return False
    return True


@dataclass(frozen=True)
class EngineTokenizer:
    """The model's tokenizer as the engine needs it. ``vocab_size`` is the model's (its logits'
    width, which may exceed the tokenizer's: padded rows are never allowed); ``eos_token_ids``
    end a constrained output. ``id`` names the whole of it, for the compile cache."""

    tokenizer_json: str = field(repr=False)
    eos_token_ids: tuple[int, ...]
    vocab_size: int | None = None
    id: str = field(init=False)
    _ll: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("EngineTokenizer needs at least one end-of-sequence token id")
        digest = hashlib.sha256(self.tokenizer_json.encode("utf-8"))
        digest.update(json.dumps([list(self.eos_token_ids), self.vocab_size]).encode())
        object.__setattr__(self, "id", digest.hexdigest()[:16])
        llg = load_llguidance()
        ll = llg.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids))
        object.__setattr__(self, "_ll", ll)

    @property
    def ll(self) -> Any:
        """The llguidance ``LLTokenizer`` (built once: ~0.1 s for 4k tokens, ~1.4 s for 64k)."""
        return self._ll

    @property
    def mask_vocab(self) -> int:
        return self._ll.vocab_size

    @staticmethod
    def from_file(path: str, eos_token_ids: Sequence[int], vocab_size: int | None = None) -> EngineTokenizer:
        with open(path, encoding="utf-8") as f:
            return EngineTokenizer(f.read(), tuple(eos_token_ids), vocab_size)

    @staticmethod
    def for_model(model_dir: str | Path) -> EngineTokenizer:
        """The tokenizer a served model's constraints compile against: the directory's
        ``tokenizer.json``, the model's end-of-sequence ids and vocabulary size (config.json,
        generation_config.json). The frontend (which compiles) and the worker (which rebuilds
        matchers from the compiled text) both build it here, so they agree on token ids."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise StructuredOutputUnavailable(f"structured output needs the model's tokenizer.json ({path} is missing)")
        config = ModelConfig.from_dir(model_dir)
        return EngineTokenizer.from_file(str(path), config.eos_token_ids, config.vocab_size)


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for ``constraint``. Raises :class:`ConstraintError` for input the
    engine's front ends reject outright (a schema that is not JSON, a GBNF that does not parse);
    the rest is checked against the tokenizer by :func:`validate`."""
    llg = load_llguidance()
    m = llg.LLMatcher
    try:
        if constraint.kind == "json_schema":
            options = {**JSON_OPTIONS, "lenient": not constraint.strict}
            return m.grammar_from_json_schema(constraint.text, overrides=options)
        if constraint.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if constraint.kind == "regex":
            return m.grammar_from_regex(constraint.text)
        if constraint.kind == "choice":
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))
        return llg.grammar_from("grammar", constraint.text)
    except ValueError as e:
        raise ConstraintError(f"invalid {constraint.kind}: {e}") from None


def validate(tokenizer: EngineTokenizer, grammar: str, kind: str) -> None:
    """Raise :class:`ConstraintError` with the engine's message if ``grammar`` is invalid."""
    llg = load_llguidance()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer.ll)
    if is_error:
        raise ConstraintError(f"invalid {kind}: {messages[0].strip()}")
