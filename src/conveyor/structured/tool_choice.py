"""``tool_choice`` enforced with the JSON-schema constraint.

With ``"required"`` the output must be a non-empty JSON array of ``{"name", "arguments"}``
objects, each naming one of the tools with arguments valid for it; with a named function the
output is that function's arguments object. The constrained output is then plain JSON (no
model-specific tags), read back by :func:`constrained_tool_calls`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from conveyor.structured.constraint import Constraint, ConstraintError
from conveyor.structured.tool_calls import new_call_id


def _functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConstraintError(f"tools[{i}]: needs a function with a name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise ConstraintError(f"tools[{i}].function.parameters: must be a JSON schema object")
        out[fn["name"]] = params
    return out


def tool_choice_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> Constraint | None:
    """The constraint for ``tool_choice``; None for ``"auto"``/``"none"`` (nothing enforced)."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        if not functions:
            raise ConstraintError('tool_choice: "required" needs at least one tool')
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in functions.items()
        ]
        return Constraint.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": options}})
    name = _named(tool_choice)
    if name not in functions:
        raise ConstraintError(f"tool_choice: no tool named {name!r}")
    return Constraint.json_schema(dict(functions[name]))


def _named(tool_choice: Any) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ConstraintError(
            'tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
        )
    return fn["name"]


def constrained_tool_calls(
    text: str, tool_choice: Any, make_id: Callable[[], str] = new_call_id
) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` from the output of :func:`tool_choice_constraint`'s constraint."""
    value = json.loads(text)
    pairs = (
        [(c["name"], c["arguments"]) for c in value] if tool_choice == "required" else [(_named(tool_choice), value)]
    )
    return [
        {
            "index": i,
            "id": make_id(),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
        }
        for i, (name, args) in enumerate(pairs)
    ]
