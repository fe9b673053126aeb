"""A reasoning budget: ``max_reasoning_tokens`` (chat, Responses; Messages'
``thinking.budget_tokens``) caps the think block, which is closed when the budget is spent.

The budget is a grammar constraint on the answer (the existing constraint path: compiled by the
frontend, applied by the worker as any ``guided_grammar``), written for the server's
``--reasoning-parser`` format: the think block (opened by the model for ``qwen3``, by the
template for ``deepseek_r1``), its text a rule of at most N tokens, then ``</think>``, which is
the only token allowed once the N are spent (the model may close it earlier), then the answer:
any tokens, or the answer's own constraint (``response_format``'s JSON schema or JSON object,
a regex, a choice). The tags are the tokenizer's own ``<think>`` / ``</think>`` tokens (Qwen3's and
DeepSeek-R1's are single added tokens; a tokenizer without them is the frontend's 400).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from conveyor.http.errors import bad_field
from conveyor.http.openai_requests import GenerationJob
from conveyor.structured.grammar_engine import JSON_OPTIONS


def budgeted(
    job: GenerationJob, budget: Any, reasoning_parser: str | None, field: str = "max_reasoning_tokens"
) -> GenerationJob:
    """``job`` with its think block capped at ``budget`` tokens (None: as it is); a 400 naming
    ``field`` for a budget that is not a non-negative integer, without a reasoning parser, or
    beside a constraint it cannot follow (a grammar, a forcing ``tool_choice``)."""
    if budget is None:
        return job
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise bad_field(field, f"'{field}' must be an integer >= 0, got {budget!r}")
    if reasoning_parser is None:
        raise bad_field(
            field, f"'{field}' needs a server started with --reasoning-parser (which says where the think block is)"
        )
    if (job.options.get("chat_template_kwargs") or {}).get("enable_thinking") is False:
        raise bad_field(
            field,
            f"'{field}' with thinking off (chat_template_kwargs.enable_thinking false): there is no think block to cap",
        )
    if job.forced_tool_choice is not None:
        raise bad_field(
            field,
            f"'{field}' cannot be combined with a tool_choice that forces calls (the calls' JSON starts at the "
            "first token)",
        )
    answer = _answer(job.options.get("constraint"), field)
    opening = "<think> " if reasoning_parser == "qwen3" else ""
    thought = f"thought[max_tokens={budget}]: /(?s:.*)/\n" if budget else 'thought: ""\n'
    grammar = f"start: {opening}thought </think> answer\n{thought}answer: {answer}\n"
    return replace(job, options={**job.options, "constraint": {"type": "grammar", "grammar": grammar}})


def _answer(constraint: dict[str, Any] | None, field: str) -> str:
    """The grammar of what follows ``</think>``: the job's own constraint, or any tokens."""
    if constraint is None:
        return "<[*]>*"
    kind = constraint.get("type")
    if kind in ("json_schema", "json_object"):
        schema = constraint.get("schema", {}) if kind == "json_schema" else {"type": "object"}
        if not isinstance(schema, dict):
            raise bad_field(field, f"'{field}' with a JSON schema that is not an object")
        options = {**JSON_OPTIONS, "lenient": not constraint.get("strict", True)}
        return "%json " + json.dumps({**schema, "x-guidance": options})
    if kind == "regex" and isinstance(constraint.get("pattern"), str):
        return "/" + constraint["pattern"].replace("/", "\\/") + "/"
    if (
        kind == "choice"
        and isinstance(constraint.get("choices"), list)
        and all(isinstance(c, str) for c in constraint["choices"])
    ):
        return " | ".join(json.dumps(c) for c in constraint["choices"])
    raise bad_field(field, f"'{field}' cannot be combined with a {kind} constraint (give the budget or the grammar)")
