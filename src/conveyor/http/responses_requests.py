"""OpenAI Responses request bodies (``POST /v1/responses``) -> the chat body they mean -> a
:class:`GenerationJob` (:func:`responses_job`), as :mod:`conveyor.http.anthropic_requests`
does for Messages: the same chat template, tokenization, sampling, constraint and tool-call
paths, the frontend's refusals naming the chat field. What is translated:

- ``input``: a string (one user turn) or items: messages (``role`` user / system / developer
  (a system turn) / assistant, ``content`` a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (the assistant turn's ``tool_calls``, consecutive calls one turn)
  and ``function_call_output`` items (``tool`` turns); ``reasoning`` items of an earlier answer
  are dropped (the templates drop earlier reasoning too). ``instructions``: a first system turn.
- ``max_output_tokens`` -> ``max_tokens``; ``temperature``, ``top_p``, ``stream`` as they are;
  vLLM's extras (``seed``, ``top_k``, ``min_p``, penalties, ``stop``, ``ignore_eos``,
  ``chat_template_kwargs``, ``structured_outputs`` ...: :data:`_EXTRAS`) as the chat route
  takes them.
- ``tools`` (``{type: function, name, description, parameters}``) -> chat's function tools;
  ``tool_choice`` ``auto`` / ``none`` / ``required`` / ``{type: function, name}`` as on chat.
- ``text.format`` (``text``, ``json_object``, ``json_schema``) -> ``response_format``;
  ``max_reasoning_tokens`` (Conveyor's, as on chat) is applied by :mod:`conveyor.http.reasoning_budget`.
- No server-side state: ``store: true``, ``previous_response_id``, ``conversation`` and
  ``background: true`` are a 400 saying so (send the whole conversation in ``input``).
  ``metadata``, ``user``, ``include``, ``reasoning`` ... (:data:`_IGNORED`): no effect here,
  named in ``x-conveyor-ignored-fields``; other fields as the OpenAI routes take unknown ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from conveyor.http.errors import ApiError, bad_field
from conveyor.http.openai_requests import CHAT, GenerationJob, parse_request, unknown_fields

_IGNORED = (
    "include",
    "metadata",
    "parallel_tool_calls",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "stream_options",
    "truncation",
    "user",
    "max_tool_calls",
)
_SAMPLING = ("temperature", "top_p", "stream")
# vLLM's extras of its Responses request, taken as the chat route takes them.
_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "priority",
    "chat_template_kwargs",
    "skip_special_tokens",
    "structured_outputs",
)
_STATEFUL = ("store", "previous_response_id", "conversation", "background", "prompt")
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "tools",
        "tool_choice",
        "text",
        "top_logprobs",
        "max_reasoning_tokens",
        *_IGNORED,
        *_SAMPLING,
        *_EXTRAS,
        *_STATEFUL,
    }
)
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses body as a chat job, with what the response object echoes of the body."""

    job: GenerationJob
    echo: dict[str, Any]


def responses_job(body: Any, served_model: str, loras: Sequence[str] = (), strict: bool = False) -> ResponsesRequest:
    """The job of a ``/v1/responses`` body; :class:`ApiError` naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = unknown_fields(body, FIELDS, strict)
    _refuse_state(body)
    chat: dict[str, Any] = {"model": body.get("model")}
    for name in (*_SAMPLING, *_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise bad_field("max_output_tokens", f"'max_output_tokens' must be an integer >= 1, got {limit!r}")
        chat["max_tokens"] = limit
    if body.get("top_logprobs") not in (None, 0):
        raise bad_field("top_logprobs", "'top_logprobs' is not supported on /v1/responses (only 0 or null)")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_field("instructions", "'instructions' must be a string")
    turns = ([{"role": "system", "content": instructions}] if instructions else []) + _turns(body.get("input"))
    chat["messages"] = turns
    if turns[-1]["role"] == "assistant" and not turns[-1].get("tool_calls"):  # a prefill: the answer continues it
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    tools = body.get("tools")
    if tools:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        mapped = _tool_choice(choice)
        if tools or mapped not in ("auto", "none"):
            chat["tool_choice"] = mapped
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    job = parse_request(CHAT, chat, served_model, loras, strict=True)
    ignored = [n for n in _IGNORED if body.get(n) is not None]
    job = replace(job, ignored=tuple(sorted([*job.ignored, *ignored, *unknown])), unknown=unknown)
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": tools or [],
        "tool_choice": choice if choice is not None else "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "metadata": body.get("metadata") or {},
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "user": body.get("user"),
        "reasoning": body.get("reasoning"),
    }
    return ResponsesRequest(job, echo)


def _refuse_state(body: dict[str, Any]) -> None:
    """A 400 for what needs responses kept at the server: Conveyor keeps none (docs/http.md)."""
    if body.get("store") is True:
        raise bad_field(
            "store",
            "'store': true is not supported: this server keeps no responses (send 'store': false, "
            "and the whole conversation in 'input')",
        )
    for name in ("previous_response_id", "conversation", "prompt"):
        if body.get(name) is not None:
            raise bad_field(
                name,
                f"'{name}' is not supported: this server keeps no responses, conversations or prompts; "
                "send the whole conversation in 'input'",
            )
    if body.get("background") is True:
        raise bad_field(
            "background", "'background': true is not supported (responses are answered, or streamed, at once)"
        )


def _turns(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_field("input", "'input' must be a string or a non-empty array of input items")
    turns: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_field("input", f"'input'[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            turns.append(_message(item, i))
        elif kind == "function_call":
            _call(turns, item, i)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_field("input", f"'input'[{i}]: a function_call_output needs its 'call_id'")
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"input[{i}].output"),
                }
            )
        elif kind != "reasoning":
            raise bad_field(
                "input",
                f"'input'[{i}]: items of type {kind!r} are not supported (only message, function_call, "
                "function_call_output and reasoning)",
            )
    if not turns:
        raise bad_field("input", "'input' holds no message")
    return turns


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_field("input", f"'input'[{i}].role must be user, system, developer or assistant")
    return {
        "role": "system" if role == "developer" else role,
        "content": _text(item.get("content"), f"input[{i}].content"),
    }


def _call(turns: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    """A ``function_call`` item as a tool call of the assistant turn before it (a new one
    unless the last turn is the assistant's)."""
    if (
        not isinstance(item.get("call_id"), str)
        or not isinstance(item.get("name"), str)
        or not isinstance(item.get("arguments"), str)
    ):
        raise bad_field(
            "input", f"'input'[{i}]: a function_call needs 'call_id', 'name' and 'arguments' (a JSON string)"
        )
    try:
        arguments: Any = json.loads(item["arguments"])  # the templates write a mapping as JSON themselves
    except ValueError:
        raise bad_field("input", f"'input'[{i}].arguments must be a JSON text") from None
    call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
    if not turns or turns[-1]["role"] != "assistant":
        turns.append({"role": "assistant", "content": None})
    turns[-1].setdefault("tool_calls", []).append(call)


def _text(content: Any, where: str) -> str:
    """A string, or the text parts of a content array joined; a 400 naming ``where`` otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field("input", f"'{where}' must be a string or an array of content parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_field(
                "input",
                f"'{where}'[{k}]: content parts of type {kind!r} are not supported (only input_text, output_text)",
            )
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_field("tools", "'tools' must be an array of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_field("tools", f"'tools'[{i}]: tools of type {kind!r} are not supported (only function tools)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_field("tools", f"'tools'[{i}] needs a non-empty 'name'")
        function: dict[str, Any] = {
            "name": tool["name"],
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
        }
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field("tool_choice", "'tool_choice' must be auto, none, required or {type: function, name}")


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_field("text", "'text' must be an object of 'format' (and 'verbosity')")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "output"),
                "schema": fmt["schema"],
                "strict": fmt.get("strict") is True,
            },
        }
    raise bad_field(
        "text", "'text.format' must be {type: text}, {type: json_object} or {type: json_schema, name, schema, strict}"
    )
