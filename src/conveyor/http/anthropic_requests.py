"""Anthropic Messages request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``)
-> the OpenAI chat body they mean -> a :class:`GenerationJob` (:func:`parse_request`).

So a Messages request is a chat request in all but its spelling: the same chat template,
tokenization, sampling fields, constraint and tool-call paths, the same validation (the
frontend's refusals name the chat field, which :func:`anthropic_param` maps back where the
names differ). What is translated:

- ``system`` (a string or text blocks) -> a first ``system`` turn; ``messages`` -> chat turns:
  ``text`` blocks are joined; a user turn's ``tool_result`` blocks become ``tool`` turns (before
  its text), an assistant turn's ``tool_use`` blocks its ``tool_calls``. A last assistant turn
  is a prefill: the answer continues it (``continue_final_message``).
- ``max_tokens`` (required), ``temperature``, ``top_p``, ``top_k``, ``stream`` as they are, and
  ``seed`` (not Anthropic's: the OpenAI routes' reproducible sampling, as vLLM accepts it);
  ``stop_sequences`` -> ``stop`` with the stop text kept in the output, so the answer can say
  which sequence ended it (``stop_sequence``; :class:`conveyor.http.anthropic_responses.StopTail`
  strips it).
- ``tools`` (``name``, ``description``, ``input_schema``) -> function tools; ``tool_choice``
  ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` / the named function /
  ``none`` (``any`` and ``tool`` force calls through the JSON-schema constraint).
- ``output_config.format`` (a JSON schema) -> ``response_format`` (the JSON-schema constraint).
- ``metadata``, ``service_tier``, ``cache_control`` and the other fields of :data:`_IGNORED`,
  ``output_config.effort`` and ``tool_choice.disable_parallel_tool_use``: no effect here,
  reported in ``x-conveyor-ignored-fields``; ``thinking`` ``enabled`` / ``adaptive`` /
  ``disabled`` -> the templates' ``enable_thinking`` (the reasoning comes back as ``thinking``
  blocks with ``--reasoning-parser``); other fields as the OpenAI routes take unknown ones
  (ignored and reported, a 400 with ``--strict-fields``). An assistant turn's ``thinking``
  blocks are dropped (as the templates drop earlier reasoning); blocks other than text,
  tool_use, tool_result and thinking (images, documents) are a 400 naming the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from conveyor.http.errors import ApiError, bad_field
from conveyor.http.openai_requests import CHAT, GenerationJob, parse_request, unknown_fields

# The Messages API's request fields (count_tokens takes all but the sampling ones).
# Fields with no effect here (caching hints: the prefix cache is automatic; routing, billing and
# speed tiers of Anthropic's service).
_IGNORED = (
    "cache_control",
    "diagnostics",
    "inference_geo",
    "metadata",
    "service_tier",
    "speed",
    "user_profile_id",
    "workspace_id",
)
COUNT_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", *_IGNORED}
)
MESSAGE_FIELDS = COUNT_FIELDS | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "seed", "stream"}


def messages_job(
    body: Any, served_model: str, loras: Sequence[str] = (), strict: bool = False, count_only: bool = False
) -> GenerationJob:
    """The job of a ``/v1/messages`` body (``count_only``: of a ``count_tokens`` body, whose
    job is only rendered and counted); :class:`ApiError` naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = unknown_fields(body, COUNT_FIELDS if count_only else MESSAGE_FIELDS, strict)
    chat: dict[str, Any] = {"model": body.get("model")}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise bad_field("max_tokens", "'max_tokens' is required: the most tokens to generate")
        chat["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k", "seed", "stream"):
            if body.get(name) is not None:
                chat[name] = body[name]
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad_field("stop_sequences", "'stop_sequences' must be an array of non-empty strings")
            if stops:
                chat["stop"], chat["include_stop_str_in_output"] = stops, True
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    turns = _system(body.get("system")) + _turns(body.get("messages"))
    chat["messages"] = turns
    if turns[-1]["role"] == "assistant":  # a prefill: the answer continues it
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    ignored = [n for n in _IGNORED if body.get(n) is not None]
    output = body.get("output_config")
    if output is not None:
        chat.update(_output_config(output, ignored))
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        mapped, parallel = _tool_choice(choice)
        if tools or mapped not in ("auto", "none"):  # auto / none without tools: nothing to choose
            chat["tool_choice"] = mapped
        if parallel:
            ignored.append("tool_choice.disable_parallel_tool_use")
    job = parse_request(CHAT, chat, served_model, loras, strict=True)
    return replace(job, ignored=tuple(sorted([*job.ignored, *ignored, *unknown])), unknown=unknown)


def _thinking(thinking: Any) -> bool | None:
    """``thinking`` as the templates' ``enable_thinking`` (None: not given). Reasoning comes
    back as ``thinking`` blocks where the server runs a ``--reasoning-parser``."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_field(
            "thinking", "'thinking' must be {type: enabled, budget_tokens}, {type: adaptive} or {type: disabled}"
        )
    return kind != "disabled"


def thinking_budget(body: dict[str, Any]) -> Any:
    """``thinking.budget_tokens`` of an ``enabled`` thinking (None: no budget), the reasoning
    budget (:mod:`conveyor.http.reasoning_budget`) where the server has a reasoning parser."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return thinking.get("budget_tokens")
    return None


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    return [{"role": "system", "content": _texts(system, "system", ("text",))}]


def _texts(blocks: Any, where: str, allowed: tuple[str, ...]) -> str:
    """The text of ``blocks`` (a string, or content blocks of the ``allowed`` types, whose
    text ones are joined); a 400 naming ``where`` for anything else."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_field(where.split("[")[0], f"'{where}' must be a string or an array of content blocks")
    texts = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise bad_field(
                where.split("[")[0],
                f"'{where}'[{i}]: content blocks of type {kind!r} are not supported here (only {', '.join(allowed)})",
            )
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_field(where.split("[")[0], f"'{where}'[{i}].text must be a string")
            texts.append(block["text"])
    return "".join(texts)


def _turns(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "'messages' must be a non-empty array of {role, content} objects")
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad_field(
                "messages", f"'messages'[{i}].role must be 'user' or 'assistant' (the system prompt is 'system')"
            )
        content = message.get("content")
        where = f"messages[{i}].content"
        if role == "user":
            if isinstance(content, list):
                for block in content:
                    if isinstance(block, dict) and block.get("type") == "tool_result":
                        turns.append(_tool_result(block, where))
            text = _texts(content, where, ("text", "tool_result"))
            if text or not isinstance(content, list):
                turns.append({"role": "user", "content": text})
        else:
            text = _texts(
                content, where, ("text", "tool_use", "thinking", "redacted_thinking")
            )  # earlier reasoning dropped
            calls = (
                [_tool_use(b, where) for b in content if b.get("type") == "tool_use"]
                if isinstance(content, list)
                else []
            )
            turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                turn["tool_calls"] = calls
            turns.append(turn)
    return turns


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_field("messages", f"'{where}': a tool_result block needs its 'tool_use_id'")
    content = block.get("content", "")
    text = _texts(content, where + ".tool_result.content", ("text",))
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if (
        not isinstance(block.get("id"), str)
        or not isinstance(block.get("name"), str)
        or not isinstance(block.get("input"), dict)
    ):
        raise bad_field("messages", f"'{where}': a tool_use block needs 'id', 'name' and an object 'input'")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_field("tools", "'tools' must be an array of {name, description, input_schema} objects")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_field("tools", f"'tools'[{i}] must be an object with a non-empty 'name'")
        if tool.get("type") not in (None, "custom"):
            raise bad_field(
                "tools",
                f"'tools'[{i}]: tools of type {tool['type']!r} (server tools) are not supported; "
                "give client tools: {name, description, input_schema}",
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_field("tools", f"'tools'[{i}].input_schema must be a JSON schema object")
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _output_config(output: Any, ignored: list[str]) -> dict[str, Any]:
    """``output_config``: its ``format`` (a JSON schema) as the chat's ``response_format``
    (the JSON-schema constraint, strict); its ``effort`` has no effect here (reported)."""
    if not isinstance(output, dict) or set(output) - {"format", "effort"}:
        raise bad_field("output_config", "'output_config' must be an object of 'format' and/or 'effort'")
    if output.get("effort") is not None:
        ignored.append("output_config.effort")
    fmt = output.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_field("output_config", "'output_config.format' must be {type: json_schema, schema: {...}}")
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True},
        }
    }


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """The chat ``tool_choice`` of an Anthropic one, and whether it set ``disable_parallel_tool_use``."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is not None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_field(
        "tool_choice", "'tool_choice' must be {type: auto}, {type: any}, {type: tool, name} or {type: none}"
    )
