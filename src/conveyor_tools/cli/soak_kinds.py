"""bin/soak's request kinds beyond plain ones, and the checks of what they return.

A plain draw (soak.py) is extended here, per :class:`Mix`, with: ``n`` in {2, 3} (sometimes
``best_of`` = n + 1, unstreamed only, as the protocol wants), ``logprobs: k`` and
``prompt_logprobs: k``, a constraint (JSON schema, regex, choice; ``tool_choice: required``
over ``tools`` for chats), ``speculate: false`` and ``lora`` naming one of the server's
adapters. A constrained request draws no stop string (a cut text could not be checked).

The checks hold for every choice of a final, as for a single result: no more tokens than
``max_tokens``, no stop string in its text, a choice that ended with ``stop`` under a
constraint is valid under it (``jsonschema`` for a schema, ``re.fullmatch`` for a regex), and
the log-probability columns have one row per token (a choice's output rows start at the
prompt's length, the prompt's rows at 1 and number one less than its tokens). Greedy choices
agree with each other and, where no mask applies (constraint, tools, ``ignore_eos``), take
the token their columns rank first (both are the raw logits' argmax).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from conveyor.client import CompletionResult

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["word", "count"],
    "additionalProperties": False,
}
REGEX = "(the|of|and|to) [a-z]{1,5}( [a-z]{1,5})?"
CHOICES = ["yes", "no", "maybe later"]
CONSTRAINTS = (
    {"type": "json_schema", "schema": SCHEMA},
    {"type": "regex", "pattern": REGEX},
    {"type": "choice", "choices": CHOICES},
)
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"type": "string", "maxLength": 5}}, "required": ["key"],
        "additionalProperties": False,
    }}},
]  # fmt: skip
TOOL_CALLS_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "object", "properties": {"name": {"const": "lookup"},
                                               "arguments": TOOLS[0]["function"]["parameters"]},
              "required": ["name", "arguments"]},
}  # fmt: skip

LOGPROB_TOLERANCE = 0.02  # a replay's log-probabilities vs. under load (float32 in batches of other shapes)
MASKING_FIELDS = frozenset({"constraint", "tools", "ignore_eos"})  # greedy then need not take the raw argmax
KIND_FIELDS = frozenset({"n", "best_of", "logprobs", "prompt_logprobs", "constraint", "tools", "speculate", "lora"})


@dataclass(frozen=True)
class Mix:
    """The kinds a draw may add to a plain request; all off is the plain mix of soak.py."""

    parallel: bool = False  # n in {2, 3}, best_of
    logprobs: bool = False  # logprobs, prompt_logprobs
    constraints: bool = False  # constraint, tools
    speculate_off: bool = False  # speculate: false
    loras: tuple[str, ...] = ()  # adapters a request may name

    @classmethod
    def every_kind(cls, loras: tuple[str, ...] = ()) -> Mix:
        return cls(parallel=True, logprobs=True, constraints=True, speculate_off=True, loras=loras)


def add_kinds(rng: random.Random, mix: Mix, fields: dict[str, Any], chat: bool) -> None:
    """Add ``mix``'s kinds to a drawn request's ``fields`` (in place): each with its own odds,
    so most requests stay plain and the kinds meet each other now and then."""
    if mix.parallel and rng.random() < 0.2:
        fields["n"] = rng.choice((2, 3))
        if rng.random() < 0.25:
            fields["best_of"] = fields["n"] + 1  # unstreamed only (see unstreamable)
    if mix.logprobs and rng.random() < 0.25:
        fields["logprobs"] = rng.randint(0, 3)
    if mix.logprobs and rng.random() < 0.1:
        fields["prompt_logprobs"] = rng.randint(0, 2)
    if mix.constraints and rng.random() < 0.15:
        fields.pop("stop", None)
        if chat and rng.random() < 0.3:
            fields.update(tools=TOOLS, tool_choice="required")
        else:
            fields["constraint"] = rng.choice(CONSTRAINTS)
    if mix.speculate_off and rng.random() < 0.2:
        fields["speculate"] = False
    if mix.loras and rng.random() < 0.4:
        fields["lora"] = rng.choice(mix.loras)


def unstreamable(fields: dict[str, Any]) -> bool:
    """``best_of`` above ``n`` is refused with ``stream`` (the best are known only at the end)."""
    return fields.get("best_of", 1) > fields.get("n", 1)


def constraint_violation(fields: dict[str, Any], text: str) -> str | None:
    """Why ``text`` (a choice that ended with ``stop``) breaks its request's constraint, or None."""
    constraint = fields.get("constraint")
    try:
        if fields.get("tool_choice") == "required":
            jsonschema.validate(json.loads(text), TOOL_CALLS_SCHEMA)
        elif constraint is None:
            return None
        elif constraint["type"] == "json_schema":
            jsonschema.validate(json.loads(text), constraint["schema"])
        elif constraint["type"] == "regex" and not re.fullmatch(constraint["pattern"], text):
            return f"does not match {constraint['pattern']!r}"
        elif constraint["type"] == "choice" and text not in constraint["choices"]:
            return f"is none of {constraint['choices']}"
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"is invalid: {str(exc).splitlines()[0]}"
    return None


def _rows(columns: dict[str, Any], k: int) -> str | None:
    """Why a log-probability column map is malformed for ``k`` alternatives, or None."""
    lengths = {name: len(columns[name]) for name in ("tokens", "token_logprobs", "top_token_ids", "top_logprobs")}
    if len(set(lengths.values())) != 1:
        return f"columns of different lengths {lengths}"
    if any(len(row) != k for row in columns["top_token_ids"]):
        return f"top rows not of {k}"
    return None


def check_choices(fields: dict[str, Any], result: CompletionResult, raw_prompt: bool) -> list[str]:
    """Every check of the module docstring on a final that is not an error; the failures.
    ``raw_prompt``: the prompt was token ids, which may end inside a character; its U+FFFD
    then leads the output's text (frontend/detokenizer.py), ahead of what a constraint bound."""
    failures = []
    n, k, prompt_k = fields.get("n", 1), fields.get("logprobs"), fields.get("prompt_logprobs")
    if len(result.choices) != n or [c.index for c in result.choices] != list(range(n)):
        failures.append(f"{len(result.choices)} choices (indices {[c.index for c in result.choices]}) for n={n}")
    prompt_len = result.usage.prompt_tokens
    greedy = fields.get("temperature") == 0
    if greedy and len({tuple(c.token_ids) for c in result.choices}) > 1:
        failures.append(f"greedy choices differ: {[c.token_ids for c in result.choices]}")
    for choice in result.choices:
        name = f"choice {choice.index}"
        if len(choice.token_ids) > fields["max_tokens"]:
            failures.append(f"{name}: {len(choice.token_ids)} tokens for max_tokens={fields['max_tokens']}")
        stops = [stop for stop in fields.get("stop", ()) if stop in choice.text]
        failures += [f"{name}: stop string {stop!r} in its text {choice.text[:80]!r}" for stop in stops]
        bound = choice.text.lstrip("\ufffd") if raw_prompt else choice.text
        violation = constraint_violation(fields, bound) if choice.finish_reason == "stop" else None
        if violation:
            failures.append(f"{name}: text {choice.text[:120]!r} {violation}")
        if k is None:
            continue
        columns = choice.logprobs
        if columns is None:
            failures.append(f"{name}: no logprobs for logprobs={k}")
        elif len(columns["token_logprobs"]) != len(choice.token_ids) or (
            choice.token_ids and columns["start"] != prompt_len
        ):
            failures.append(
                f"{name}: {len(columns['token_logprobs'])} logprob rows from {columns['start']} for "
                f"{len(choice.token_ids)} tokens after a prompt of {prompt_len}"
            )
        elif bad := _rows(columns, k):
            failures.append(f"{name}: logprobs {bad}")
        elif greedy and k and not MASKING_FIELDS & fields.keys():
            # Unmasked greedy takes the raw logits' argmax, which the columns rank first.
            firsts = [row[0] for row in columns["top_token_ids"]]
            if firsts != choice.token_ids:
                failures.append(f"{name}: greedy tokens {choice.token_ids} are not the most likely {firsts}")
    if prompt_k is not None:
        columns = result.prompt_logprobs
        if columns is None or len(columns["token_logprobs"]) != prompt_len - 1 or columns["start"] != 1:
            rows = None if columns is None else (columns["start"], len(columns["token_logprobs"]))
            failures.append(f"prompt_logprobs (start, rows) {rows} for a prompt of {prompt_len}")
        elif bad := _rows(columns, prompt_k):
            failures.append(f"prompt_logprobs {bad}")
    return failures


def outcome(result: CompletionResult) -> list[tuple[list[int], str, str]]:
    """What a replay must reproduce: each choice's tokens, finish reason and text."""
    return [(c.token_ids, c.finish_reason, c.text) for c in result.choices]


def logprobs_drift(a: CompletionResult, b: CompletionResult) -> float:
    """The largest difference of a token's log-probability between two finals of the same
    tokens (0 without logprobs): batches of other sizes change float32 sums only a little."""
    pairs = [(x.logprobs, y.logprobs) for x, y in zip(a.choices, b.choices)] + [(a.prompt_logprobs, b.prompt_logprobs)]
    return max(
        (
            abs(u - v)
            for x, y in pairs
            if x and y
            for u, v in zip(x["token_logprobs"], y["token_logprobs"], strict=True)
        ),
        default=0.0,
    )
