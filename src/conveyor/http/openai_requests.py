"""OpenAI request bodies -> client-protocol generate fields.

This module checks only what the OpenAI API has and the client protocol does not: the body
is a JSON object, ``model`` names the served model, the shape of ``prompt`` and
``messages``, ``n``, ``stream``/``stream_options``, and the OpenAI fields Conveyor cannot
honour (``logprobs``, penalties, ``echo``, tools ...), each refused by name unless it holds
its do-nothing value. Every value that has a protocol field (``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop`` and the extras ``top_k``, ``min_p``,
``priority``, ``ignore_eos``, ``stop_token_ids``) travels as it came: the frontend validates
it (``protocol.messages``), and its refusal names the field (mapped to a 400 by
:mod:`conveyor.http.errors`), so the rules live in one place.

Invariant: what this module forwards is made of strings, integers, booleans and the scalars
the client sent for protocol fields, never arbitrary JSON, so the packed client message is
at most a few hundred bytes larger than the body it came from (see :mod:`conveyor.http.app`,
which bounds the body below the protocol's message limit by that much).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.http.errors import ApiError, bad_field

COMPLETION = "completion"
CHAT = "chat"
# Prompts one /v1/completions body may hold (each one request at the server).
MAX_PROMPTS = 1024

# Client-protocol option fields taken from the body as they are (protocol.messages.OPTION_FIELDS
# less max_tokens, which has two OpenAI spellings).
_PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "priority")
# OpenAI fields with no effect here, accepted and ignored.
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# OpenAI fields Conveyor does not implement: accepted only with the value that asks for nothing.
_INERT: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "top_logprobs": (0,),
    "response_format": ({"type": "text"},),
}
_COMMON = frozenset(
    {"model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens", "logprobs", *_PASSED_THROUGH, *_IGNORED, *_INERT}
)
_FIELDS = {COMPLETION: _COMMON | {"prompt"}, CHAT: _COMMON | {"messages"}}


@dataclass(frozen=True)
class GenerationJob:
    """One OpenAI request as client-protocol requests: one per entry of ``inputs`` (each
    ``{"prompt": str}``, ``{"token_ids": [int]}`` or ``{"messages": [...]}``), all with
    ``options`` (protocol option fields, no None values)."""

    kind: str  # COMPLETION or CHAT
    inputs: list[dict[str, Any]]
    options: dict[str, Any]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def parse_request(kind: str, body: Any, served_model: str) -> GenerationJob:
    """The job for a decoded body of ``/v1/completions`` (``kind`` COMPLETION) or
    ``/v1/chat/completions`` (CHAT); :class:`ApiError` (400, 404) naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise bad_field(unknown[0], f"unrecognized request field(s): {', '.join(map(repr, unknown))}")
    _check_model(body.get("model"), served_model)
    _check_unsupported(body, kind)
    stream, include_usage = _stream_flags(body)
    inputs = _prompts(body.get("prompt")) if kind == COMPLETION else [{"messages": _messages(body.get("messages"))}]
    options = {name: _forwardable(name, body[name]) for name in _PASSED_THROUGH if body.get(name) is not None}
    for name in ("max_completion_tokens", "max_tokens"):  # the newer spelling wins
        if body.get(name) is not None:
            options["max_tokens"] = _forwardable(name, body[name])
            break
    return GenerationJob(kind, inputs, options, stream, include_usage)


def _forwardable(name: str, value: Any) -> Any:
    """``value`` if it can travel in a client message as it is (the frontend then judges it):
    a scalar, or for ``stop`` / ``stop_token_ids`` an array of strings / integers. Anything
    else is refused here, naming the field, to keep the module's size invariant (and msgpack
    cannot carry integers past 64 bits)."""
    if isinstance(value, (str, bool, float)) or _is_int(value):
        return value
    if name == "stop" and isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    if name == "stop_token_ids" and isinstance(value, list) and all(_is_int(t) for t in value):
        return value
    if name == "stop":
        raise bad_field(name, f"'stop' must be a string or an array of strings, got {_json_type(value)}")
    if name == "stop_token_ids":
        raise bad_field(name, "'stop_token_ids' must be an array of integers")
    if isinstance(value, int) and not isinstance(value, bool):
        raise bad_field(name, f"'{name}' is out of range, got {value}")
    raise bad_field(name, f"'{name}' must be a {'boolean' if name == 'ignore_eos' else 'number'}, got {_json_type(value)}")


def _check_model(model: Any, served_model: str) -> None:
    if model is None:
        raise bad_field("model", "'model' is required")
    if not isinstance(model, str):
        raise bad_field("model", f"'model' must be a string, got {_json_type(model)}")
    if model != served_model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_model}'", param="model", code="model_not_found")


def _check_unsupported(body: dict[str, Any], kind: str) -> None:
    n = body.get("n")
    if n is not None:
        if not _is_int(n) or n < 1:
            raise bad_field("n", f"'n' must be an integer >= 1, got {n!r}")
        if n > 1:
            raise bad_field("n", "n > 1 is not supported: send the request n times (with different seeds)")
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        raise bad_field("logprobs", "'logprobs' is not supported: the worker does not return log probabilities")
    for name, inert in _INERT.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in inert):
            raise bad_field(name, f"'{name}' is not supported (only {inert[0]!r} or null is accepted), got {value!r}")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_field("stream", f"'stream' must be a boolean, got {_json_type(stream)}")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise bad_field("stream_options", f"'stream_options' must be an object, got {_json_type(options)}")
    if not stream:
        raise bad_field("stream_options", "'stream_options' is only allowed with 'stream': true")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad_field("stream_options", f"unrecognized field(s) of 'stream_options': {', '.join(map(repr, unknown))}")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_field("stream_options", f"'stream_options.include_usage' must be a boolean, got {_json_type(include_usage)}")
    return True, bool(include_usage)


_PROMPT_SHAPE = "'prompt' must be a string, an array of strings, an array of token ids or an array of arrays of token ids"


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    """One input per prompt: a string, strings, token ids, or lists of token ids."""
    if prompt is None:
        raise bad_field("prompt", "'prompt' is required")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise bad_field("prompt", _PROMPT_SHAPE + (", got an empty array" if prompt == [] else f", got {_json_type(prompt)}"))
    if all(_is_int(t) for t in prompt):
        return [{"token_ids": prompt}]
    if len(prompt) > MAX_PROMPTS:
        raise bad_field("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return [{"token_ids": p} for p in prompt]
    raise bad_field("prompt", _PROMPT_SHAPE)


def _messages(messages: Any) -> list[dict[str, str]]:
    """The chat turns as ``{role, content[, name]}`` with string content (an array of text
    parts is joined); anything else is refused here, since the protocol takes strings."""
    if messages is None:
        raise bad_field("messages", "'messages' is required")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "'messages' must be a non-empty array of {role, content} objects")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_field("messages", f"'messages'[{i}] must be an object with a string 'role'")
        turn = {"role": message["role"], "content": _content(message.get("content"), i)}
        if isinstance(message.get("name"), str):
            turn["name"] = message["name"]
        turns.append(turn)
    return turns


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_field("messages", f"'messages'[{i}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_field("messages", f"'messages'[{i}].content must be a string or an array of text parts, got {_json_type(content)}")


def _is_int(value: Any) -> bool:
    """An integer msgpack can carry (JSON allows any size; msgpack stops at 64 bits)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**64


def _json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
