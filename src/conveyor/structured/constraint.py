"""What a request asks its output to match, as one hashable value.

A :class:`Constraint` is built from client input by the frontend and is the key of the
compile cache, so it holds canonical text only (a schema is re-serialized with sorted keys:
two spellings of one schema share a cache entry). Building one checks the shape of the input
(types, sizes) and raises :class:`ConstraintError` naming the field; whether the schema,
regex or grammar itself is valid is for the engine to say (:mod:`.compiler`), also as a
:class:`ConstraintError`. Nothing here needs the engine or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# Bounds on the text of one constraint, checked before anything is compiled: a schema or a
# grammar larger than this is refused as bad input rather than handed to the engine.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_CHOICES = 4096


class ConstraintError(ValueError):
    """A constraint the server refuses: the message names what is wrong, for a 400 reply."""


@dataclass(frozen=True)
class Constraint:
    """One output constraint. ``text`` is canonical: JSON text of the schema (sorted keys),
    the regex, the grammar (GBNF/EBNF or Lark), or a JSON list of the choices; empty for
    ``json_object``. ``strict`` (json_schema only): schema keywords the engine does not
    implement are an error rather than ignored."""

    kind: Kind
    text: str = ""
    strict: bool = True

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str, *, strict: bool = True) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"json_schema: not valid JSON ({e})") from None
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"json_schema: must be a JSON object, got {type(schema).__name__}")
        return Constraint("json_schema", _bounded("json_schema", json.dumps(schema, sort_keys=True)), bool(strict))

    @staticmethod
    def json_object() -> Constraint:
        return Constraint("json_object")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError("regex: must be a non-empty string")
        return Constraint("regex", _bounded("regex", pattern))

    @staticmethod
    def choice(options: Sequence[str]) -> Constraint:
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise ConstraintError("choice: must be a list of strings")
        if not 0 < len(options) <= MAX_CHOICES:
            raise ConstraintError(f"choice: needs 1 to {MAX_CHOICES} options, got {len(options)}")
        for i, o in enumerate(options):
            if not isinstance(o, str) or not o:
                raise ConstraintError(f"choice: option {i} must be a non-empty string")
        return Constraint("choice", _bounded("choice", json.dumps(list(options), ensure_ascii=False)))

    @staticmethod
    def grammar(text: str) -> Constraint:
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("grammar: must be a non-empty string")
        return Constraint("grammar", _bounded("grammar", text))

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text) if self.kind == "choice" else []


def _bounded(field: str, text: str) -> str:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"{field}: {len(text)} characters, more than the {MAX_CONSTRAINT_CHARS} allowed")
    return text
