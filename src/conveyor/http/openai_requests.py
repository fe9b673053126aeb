"""OpenAI request bodies -> client-protocol generate fields.

Each field is taken as :data:`conveyor.http.request_fields.FIELDS` says (``forward``,
``http``, ``ignored``, ``inert``; docs/http.md lists them); this module applies that table to
a body: it handles the ``http`` fields, sends the ``forward`` ones on, reports the ``ignored``
ones and refuses an ``inert`` field that asks for something, or a field the table lacks.

Structured output (``http`` fields): ``response_format`` and vLLM's ``guided_*`` /
``structured_outputs`` become the protocol's ``constraint`` (:func:`_constraint`); ``tools``
and ``tool_choice`` are passed on as they came (the frontend renders the tools and turns a
forcing ``tool_choice`` into a constraint); the answer's tool calls are read in
:mod:`conveyor.http.generation`.

Invariant: what this module forwards is made of strings, integers, booleans and the scalars
the client sent for protocol fields, and of JSON values the body holds once (a schema, the
tools: each forwarded once, never copied), never arbitrary JSON made here (``chat_template_kwargs`` is
bounded by its packed size, :data:`MAX_TEMPLATE_KWARGS_BYTES`), so the packed
client message is at most that plus a few hundred bytes larger than the body it came from
(see :mod:`conveyor.http.app`, which bounds the body below the protocol's message limit by
that much).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from conveyor.http.errors import ApiError, bad_field
from conveyor.http.request_fields import CHAT, COMPLETION, FIELDS, FORWARD, IGNORED, INERT
from conveyor.ipc.messages import MAX_LOGIT_BIAS
from conveyor.protocol.limits import MAX_TEMPLATE_KWARGS_BYTES

# Prompts one /v1/completions body may hold (each one request at the server).
MAX_PROMPTS = 1024

_KNOWN = {kind: frozenset(n for n, f in FIELDS.items() if kind in f.endpoints) for kind in (COMPLETION, CHAT)}
_FORWARDED = {
    kind: tuple(n for n, f in FIELDS.items() if f.how == FORWARD and kind in f.endpoints) for kind in (COMPLETION, CHAT)
}


@dataclass(frozen=True)
class GenerationJob:
    """One OpenAI request as client-protocol requests: one per entry of ``inputs`` (each
    ``{"prompt": str}``, ``{"token_ids": [int]}`` or ``{"messages": [...]}``), all with
    ``options`` (protocol option fields, no None values). ``ignored``: the body's ``ignored``
    fields (header and log line); ``echo``: the prompt starts each choice's text;
    ``return_token_ids``: the choices carry their token ids and the prompt's;
    ``continuous_usage``: every streamed chunk carries the usage so far; ``logprobs``: the
    top-k asked for the output tokens (None: no logprobs object), also in ``options``;
    ``prompt_logprobs``: vLLM's per-prompt-token list is asked for."""

    kind: str  # COMPLETION or CHAT
    inputs: list[dict[str, Any]]
    options: dict[str, Any]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    ignored: tuple[str, ...] = ()
    echo: bool = False
    return_token_ids: bool = False
    continuous_usage: bool = False
    # Chat with tools: the tool_choice that forces calls (its output is then the constrained
    # JSON, read back whole), or None; whether the output is parsed for calls at all.
    forced_tool_choice: Any = None
    tools: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    unknown: tuple[str, ...] = ()  # the fields no schema knows (also in ``ignored``): a warning each

    @property
    def n(self) -> int:
        """Sequences per input (``n``): input ``i``'s sequence ``j`` is choice ``i * n + j``."""
        n = self.options.get("n", 1)
        return n if isinstance(n, int) and not isinstance(n, bool) else 1


def parse_request(
    kind: str, body: Any, served_model: str, loras: Sequence[str] = (), strict: bool = False
) -> GenerationJob:
    """The job for a decoded body of ``/v1/completions`` (``kind`` COMPLETION) or
    ``/v1/chat/completions`` (CHAT); :class:`ApiError` (400, 404) naming the field otherwise.
    ``model`` names the served model or one of the LoRA adapters ``loras``: an adapter's
    name becomes the generate request's ``lora`` option. A field neither schema has is
    ignored and reported (:func:`unknown_fields`), or with ``strict`` (``--strict-fields``) a 400."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    misplaced = sorted(set(body) - _KNOWN[kind] & FIELDS.keys())
    if misplaced:
        other = "chat" if kind == COMPLETION else "completion"
        raise bad_field(
            misplaced[0], f"{', '.join(map(repr, misplaced))}: a field of {other} requests, not of this endpoint"
        )
    unknown = unknown_fields(body, _KNOWN[kind], strict)
    if unknown:
        body = {k: v for k, v in body.items() if k not in unknown}
    lora = _check_model(body.get("model"), served_model, loras)
    _check_inert(body, kind)
    stream, include_usage, continuous_usage = _stream_flags(body)
    inputs = _prompts(body.get("prompt")) if kind == COMPLETION else [{"messages": _messages(body.get("messages"))}]
    options = {name: _forwardable(name, body[name]) for name in _FORWARDED[kind] if body.get(name) is not None}
    for name in ("max_completion_tokens", "max_tokens"):  # the newer spelling wins
        if body.get(name) is not None:
            options["max_tokens"] = _forwardable(name, body[name])
            break
    else:
        if kind == CHAT:
            options["fill_context"] = True  # OpenAI's chat default: up to the model length
    if lora is not None:
        options["lora"] = lora
    ignored = tuple(sorted([*(n for n in body if FIELDS[n].how == IGNORED and body[n] is not None), *unknown]))
    constraint = _constraint(body)
    if constraint is not None:
        options["constraint"] = constraint
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        options["tools"] = tools
    if tool_choice is not None:
        options["tool_choice"] = tool_choice
    forced = tool_choice if tools and tool_choice not in (None, "auto", "none") else None
    echo = _echo(body, kind)
    logprobs = _logprobs(body, kind)
    if logprobs is not None:
        options["logprobs"] = logprobs
        if echo:  # the echoed prompt's tokens come with theirs
            options["prompt_logprobs"] = max(logprobs, options.get("prompt_logprobs", 0))
    return GenerationJob(
        kind,
        inputs,
        options,
        stream,
        include_usage,
        ignored,
        echo=echo,
        return_token_ids=_flag(body, "return_token_ids"),
        continuous_usage=continuous_usage,
        forced_tool_choice=forced,
        tools=bool(tools) and tool_choice != "none",
        logprobs=logprobs,
        prompt_logprobs=body.get("prompt_logprobs") is not None,
        unknown=unknown,
    )


def unknown_fields(body: dict[str, Any], known: frozenset[str] | set[str], strict: bool) -> tuple[str, ...]:
    """The body's fields outside ``known``, sorted: accepted and reported, as vLLM does (a
    client written for another server sends fields of its own), or with ``strict`` a 400
    naming the first (a typo never falls back to a default)."""
    unknown = tuple(sorted(set(body) - known))
    if unknown and strict:
        raise bad_field(unknown[0], f"unrecognized request field(s): {', '.join(map(repr, unknown))} (--strict-fields)")
    return unknown


_CONSTRAINT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
# vLLM's structured_outputs keys -> the protocol's constraint
_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
_VLLM_FIELD = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


def _constraint(body: dict[str, Any]) -> dict[str, Any] | None:
    """The client-protocol ``constraint`` (docs/protocol.md) of OpenAI's ``response_format`` or
    vLLM's ``guided_*`` / ``structured_outputs``, at most one of them: shapes only, the
    frontend's compile says whether the schema, regex or grammar is valid (a 400 naming it)."""
    given = [n for n in _CONSTRAINT_FIELDS if body.get(n) is not None and body.get(n) != {"type": "text"}]
    if len(given) > 1:
        raise bad_field(given[1], f"give at most one of {', '.join(given)}")
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
            spec = value["json_schema"]
            # OpenAI's strict defaults to false: keywords the engine lacks are then ignored.
            return {"type": "json_schema", "schema": spec.get("schema", {}), "strict": spec.get("strict") is True}
        raise bad_field(
            name,
            "'response_format' must be {type: text}, {type: json_object} or {type: json_schema, json_schema: "
            "{name, schema, strict}}",
        )
    if name == "guided_json":
        return {"type": "json_schema", "schema": value, "strict": False}
    if name == "guided_regex":
        return {"type": "regex", "pattern": value}
    if name == "guided_choice":
        return {"type": "choice", "choices": value}
    if name == "guided_grammar":
        return {"type": "grammar", "grammar": value}
    chosen = [k for k in _STRUCTURED_OUTPUTS if isinstance(value, dict) and value.get(k) not in (None, False)]
    if len(chosen) != 1:
        raise bad_field(name, f"'structured_outputs' must set exactly one of {', '.join(_STRUCTURED_OUTPUTS)}")
    key = chosen[0]
    if key == "json_object":
        return {"type": "json_object"}
    return _constraint({_VLLM_FIELD[key]: value[key]})


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    """The protocol's ``logprobs`` k of a body, or None: completions' ``logprobs`` (an
    integer); chat's ``logprobs`` flag with ``top_logprobs`` (an integer, which needs the
    flag). The bound (``--max-logprobs``) is the frontend's to check."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == COMPLETION:
        if top is not None and top != 0:
            raise bad_field(
                "top_logprobs",
                "'top_logprobs' applies to chat completions (only 0 or null here): completions take 'logprobs': "
                f"k, got {top!r}",
            )
        if value is not None and (not _is_int(value) or value < 0):
            raise bad_field("logprobs", f"'logprobs' must be an integer >= 0, got {value!r}")
        return value
    if value is not None and not isinstance(value, bool):
        raise bad_field("logprobs", f"'logprobs' must be a boolean, got {_json_type(value)}")
    if top is not None:
        if not _is_int(top) or top < 0:
            raise bad_field("top_logprobs", f"'top_logprobs' must be an integer >= 0, got {top!r}")
        if top and not value:
            raise bad_field("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if value else None


def _echo(body: dict[str, Any], kind: str) -> bool:
    echo = _flag(body, "echo")
    if echo and kind == CHAT:
        raise bad_field("echo", "'echo' is not supported on chat completions (only false or null is accepted)")
    return echo


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_field(name, f"'{name}' must be a boolean, got {_json_type(value)}")
    return bool(value)


def _forwardable(name: str, value: Any) -> Any:
    """``value`` if it can travel in a client message as it is (the frontend then judges it):
    a scalar, or for ``stop`` / ``stop_token_ids`` an array of strings / integers, for
    ``logit_bias`` a map of strings to numbers of at most :data:`MAX_LOGIT_BIAS` entries
    (packed, never larger than its JSON). Anything else is refused here, naming the field, to
    keep the module's size invariant (and msgpack cannot carry integers past 64 bits)."""
    if isinstance(value, (str, bool, float)) or _is_int(value):
        return value
    if name == "chat_template_kwargs" and isinstance(value, dict):
        try:
            size = len(msgpack.packb(value))
        except (TypeError, ValueError, OverflowError):
            raise bad_field(
                name, "'chat_template_kwargs' holds a value msgpack cannot carry (an integer past 64 bits)"
            ) from None
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise bad_field(name, f"'chat_template_kwargs' exceeds {MAX_TEMPLATE_KWARGS_BYTES} bytes packed")
        return value
    if name == "stop" and isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    if name == "stop_token_ids" and isinstance(value, list) and all(_is_int(t) for t in value):
        return value
    if name == "logit_bias":
        if not isinstance(value, dict) or not all(isinstance(v, float) or _is_int(v) for v in value.values()):
            raise bad_field(name, f"'logit_bias' must be an object of token ids to numbers, got {_json_type(value)}")
        if len(value) > MAX_LOGIT_BIAS:
            raise bad_field(name, f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        return value
    if name == "stop":
        raise bad_field(name, f"'stop' must be a string or an array of strings, got {_json_type(value)}")
    if name == "stop_token_ids":
        raise bad_field(name, "'stop_token_ids' must be an array of integers")
    if isinstance(value, int) and not isinstance(value, bool):
        raise bad_field(name, f"'{name}' is out of range, got {value}")
    if name == "chat_template_kwargs":
        raise bad_field(name, f"'chat_template_kwargs' must be an object, got {_json_type(value)}")
    kind = "boolean" if name in _BOOLEAN_FIELDS else "number"
    raise bad_field(name, f"'{name}' must be a {kind}, got {_json_type(value)}")


_BOOLEAN_FIELDS = frozenset(
    {
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "add_generation_prompt",
        "continue_final_message",
    }
)


def _check_model(model: Any, served_model: str, loras: Sequence[str] = ()) -> str | None:
    """The LoRA adapter ``model`` names (None: the served base model); 404 for anything else."""
    if model is None:
        raise bad_field("model", "'model' is required")
    if not isinstance(model, str):
        raise bad_field("model", f"'model' must be a string, got {_json_type(model)}")
    if model in loras:
        return model
    if model != served_model:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this server serves '{served_model}'",
            param="model",
            code="model_not_found",
        )
    return None


def _check_inert(body: dict[str, Any], kind: str) -> None:
    """A 400 for an ``inert`` field whose value asks for something Conveyor does not do."""
    for name, value in body.items():
        spec = FIELDS[name]
        if spec.how != INERT or value is None:
            continue
        allowed = spec.inert[kind]
        if any(value == v and type(value) is type(v) for v in allowed):
            continue
        accepted = " or ".join([*map(repr, allowed), "null"])
        yet = " yet" if spec.later else ""
        raise bad_field(name, f"'{name}' is not supported{yet} (only {accepted} is accepted), got {value!r}")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage`` and ``.continuous_usage_stats`` (vLLM's)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_field("stream", f"'stream' must be a boolean, got {_json_type(stream)}")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False, False
    if not isinstance(options, dict):
        raise bad_field("stream_options", f"'stream_options' must be an object, got {_json_type(options)}")
    if not stream:
        raise bad_field("stream_options", "'stream_options' is only allowed with 'stream': true")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"})
    if unknown:
        raise bad_field("stream_options", f"unrecognized field(s) of 'stream_options': {', '.join(map(repr, unknown))}")
    flags = []
    for name in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_field("stream_options", f"'stream_options.{name}' must be a boolean, got {_json_type(value)}")
        flags.append(bool(value))
    return True, flags[0], flags[0] and flags[1]  # continuous usage only with include_usage, as vLLM


_PROMPT_SHAPE = (
    "'prompt' must be a string, an array of strings, an array of token ids or an array of arrays of token ids"
)


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    """One input per prompt: a string, strings, token ids, or lists of token ids."""
    if prompt is None:
        raise bad_field("prompt", "'prompt' is required")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise bad_field(
            "prompt", _PROMPT_SHAPE + (", got an empty array" if prompt == [] else f", got {_json_type(prompt)}")
        )
    if all(_is_int(t) for t in prompt):
        return [{"token_ids": prompt}]
    if len(prompt) > MAX_PROMPTS:
        raise bad_field("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return [{"token_ids": p} for p in prompt]
    raise bad_field("prompt", _PROMPT_SHAPE)


def _messages(messages: Any) -> list[dict[str, Any]]:
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
        calls = message.get("tool_calls")
        if calls is not None and message.get("content") is None:
            turn = {"role": message["role"], "content": None}
        else:
            turn = {"role": message["role"], "content": _content(message.get("content"), i)}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                turn[key] = message[key]
        if calls is not None:
            turn["tool_calls"] = _tool_calls(calls, i)
        turns.append(turn)
    return turns


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant turn's earlier calls, with their arguments as objects (chat templates
    write them with ``tojson``; OpenAI sends them as JSON text)."""
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
    ):
        raise bad_field("messages", f"'messages'[{i}].tool_calls must be an array of {{id, type, function}} objects")
    out = []
    for call in calls:
        fn = dict(call["function"])
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                raise bad_field("messages", f"'messages'[{i}].tool_calls: arguments are not valid JSON") from None
        out.append({**call, "function": fn})
    return out


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
    raise bad_field(
        "messages", f"'messages'[{i}].content must be a string or an array of text parts, got {_json_type(content)}"
    )


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
