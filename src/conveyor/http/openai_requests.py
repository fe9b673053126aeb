"""OpenAI request bodies -> client-protocol generate fields.

:data:`FIELDS` says how every request field of OpenAI's and vLLM's completion and chat
schemas is taken (docs/http.md lists them):

- ``forward``: a client-protocol field (``temperature``, ``seed``, ``stop``, vLLM's
  ``top_k``, ``skip_special_tokens``, ``truncate_prompt_tokens``, ``chat_template_kwargs``
  ...), sent as it came: the frontend validates it (``protocol.messages``) and its refusal
  names the field (mapped to a 400 by :mod:`conveyor.http.errors`), so the rules live in
  one place.
- ``http``: handled here (``model``, the input, ``stream``/``stream_options``,
  ``max_tokens``, ``echo``, ``return_token_ids``).
- ``ignored``: no effect on the output here (``user``, ``metadata``, vLLM's ``cache_salt``,
  ``spaces_between_special_tokens`` (the Rust tokenizers join special tokens as they are)
  ...): accepted, and listed in the response header ``x-conveyor-ignored-fields`` and a log
  line, as vLLM does.
- ``inert``: not implemented, and ignoring it would change the output: accepted only with a
  value that asks for nothing (null, or the listed ones), else a 400 naming it. Those marked
  ``later`` (log-probabilities, ``best_of``, penalties, ``logit_bias``,
  ``min_tokens``) become ``forward`` fields once the worker computes them.

A field in neither schema is a 400 naming it (a typo never falls back to a default).

Invariant: what this module forwards is made of strings, integers, booleans and the scalars
the client sent for protocol fields, never arbitrary JSON (``chat_template_kwargs``, the
one map, is bounded by its packed size, :data:`MAX_TEMPLATE_KWARGS_BYTES`), so the packed
client message is at most that plus a few hundred bytes larger than the body it came from
(see :mod:`conveyor.http.app`, which bounds the body below the protocol's message limit by
that much).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from conveyor.http.errors import ApiError, bad_field
from conveyor.protocol.messages import MAX_TEMPLATE_KWARGS_BYTES

COMPLETION = "completion"
CHAT = "chat"
# Prompts one /v1/completions body may hold (each one request at the server).
MAX_PROMPTS = 1024

FORWARD = "forward"
HTTP = "http"
IGNORED = "ignored"
INERT = "inert"
_BOTH = frozenset({COMPLETION, CHAT})


@dataclass(frozen=True)
class Field:
    """How one request field is taken: ``how`` (FORWARD, HTTP, IGNORED, INERT) on the
    ``endpoints`` that have it; for INERT, the non-null values that ask for nothing per
    endpoint and whether the field is to be implemented (``later``)."""

    how: str
    endpoints: frozenset[str] = _BOTH
    inert: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    later: bool = False


def _inert(*values: Any, later: bool = False, endpoints: frozenset[str] = _BOTH) -> Field:
    return Field(INERT, endpoints, {e: values for e in endpoints}, later)


_C, _CH = frozenset({COMPLETION}), frozenset({CHAT})
FIELDS: dict[str, Field] = {
    # OpenAI, both endpoints
    "model": Field(HTTP),
    "stream": Field(HTTP),
    "stream_options": Field(HTTP),
    "max_tokens": Field(HTTP),
    "max_completion_tokens": Field(HTTP),
    "temperature": Field(FORWARD),
    "top_p": Field(FORWARD),
    "seed": Field(FORWARD),
    "stop": Field(FORWARD),
    "n": Field(FORWARD),  # each input's n sequences are choices input * n .. input * n + n - 1
    "best_of": _inert(1, later=True),
    "logprobs": Field(INERT, _BOTH, {COMPLETION: (), CHAT: (False,)}, later=True),
    "top_logprobs": _inert(0, later=True),
    "presence_penalty": _inert(0, 0.0, later=True),
    "frequency_penalty": _inert(0, 0.0, later=True),
    "logit_bias": _inert({}, later=True),
    "response_format": _inert({"type": "text"}),
    "user": Field(IGNORED),
    "metadata": Field(IGNORED),
    "store": Field(IGNORED),
    "service_tier": Field(IGNORED),
    "prompt_cache_key": Field(IGNORED),
    "safety_identifier": Field(IGNORED),
    # OpenAI, one endpoint
    "prompt": Field(HTTP, _C),
    "echo": Field(HTTP),  # chat: only false (vLLM's echo of the last message is not done)
    "suffix": _inert("", endpoints=_C),
    "messages": Field(HTTP, _CH),
    "tools": _inert([], endpoints=_CH),
    "tool_choice": _inert("none", "auto", endpoints=_CH),
    "functions": _inert([], endpoints=_CH),
    "function_call": _inert("none", "auto", endpoints=_CH),
    "parallel_tool_calls": Field(IGNORED, _CH),
    "reasoning_effort": _inert(endpoints=_CH),
    "modalities": _inert(["text"], endpoints=_CH),
    "audio": _inert(endpoints=_CH),
    "prediction": _inert(endpoints=_CH),
    "web_search_options": _inert(endpoints=_CH),
    "verbosity": _inert(endpoints=_CH),
    # vLLM's extras, both endpoints
    "top_k": Field(FORWARD),
    "min_p": Field(FORWARD),
    "stop_token_ids": Field(FORWARD),
    "ignore_eos": Field(FORWARD),
    "priority": Field(FORWARD),
    "skip_special_tokens": Field(FORWARD),
    "include_stop_str_in_output": Field(FORWARD),
    "truncate_prompt_tokens": Field(FORWARD),
    "return_token_ids": Field(HTTP),
    "spaces_between_special_tokens": Field(IGNORED),
    "request_id": Field(IGNORED),
    "cache_salt": Field(IGNORED),
    "kv_transfer_params": Field(IGNORED),
    "vllm_xargs": Field(IGNORED),
    "return_tokens_as_token_ids": Field(IGNORED),  # shapes log-probabilities only
    "guided_decoding_backend": Field(IGNORED),  # no guided_* field is taken
    "guided_whitespace_pattern": Field(IGNORED),
    "use_beam_search": _inert(False, later=True),
    "length_penalty": _inert(1, 1.0),  # beam search only
    "repetition_penalty": _inert(1, 1.0, later=True),
    "min_tokens": _inert(0, later=True),
    "bad_words": _inert([], later=True),
    "allowed_token_ids": _inert(),
    "prompt_logprobs": _inert(later=True),
    "logits_processors": _inert(),
    "guided_json": _inert(),
    "guided_regex": _inert(),
    "guided_choice": _inert(),
    "guided_grammar": _inert(),
    "structured_outputs": _inert(),
    "add_special_tokens": Field(INERT, _BOTH, {COMPLETION: (True,), CHAT: (False,)}),
    # vLLM's extras, one endpoint
    "prompt_embeds": _inert(endpoints=_C),
    "add_generation_prompt": Field(FORWARD, _CH),
    "continue_final_message": Field(FORWARD, _CH),
    "chat_template_kwargs": Field(FORWARD, _CH),
    "chat_template": _inert(endpoints=_CH),
    "documents": _inert([], endpoints=_CH),
    "mm_processor_kwargs": Field(IGNORED, _CH),
    "include_reasoning": Field(IGNORED, _CH),  # no reasoning parser: the text is never split
}
_KNOWN = {kind: frozenset(n for n, f in FIELDS.items() if kind in f.endpoints) for kind in (COMPLETION, CHAT)}
_FORWARDED = {kind: tuple(n for n, f in FIELDS.items() if f.how == FORWARD and kind in f.endpoints) for kind in (COMPLETION, CHAT)}


@dataclass(frozen=True)
class GenerationJob:
    """One OpenAI request as client-protocol requests: one per entry of ``inputs`` (each
    ``{"prompt": str}``, ``{"token_ids": [int]}`` or ``{"messages": [...]}``), all with
    ``options`` (protocol option fields, no None values). ``ignored``: the body's ``ignored``
    fields (header and log line); ``echo``: the prompt starts each choice's text;
    ``return_token_ids``: the choices carry their token ids and the prompt's;
    ``continuous_usage``: every streamed chunk carries the usage so far."""

    kind: str  # COMPLETION or CHAT
    inputs: list[dict[str, Any]]
    options: dict[str, Any]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    ignored: tuple[str, ...] = ()
    echo: bool = False
    return_token_ids: bool = False
    continuous_usage: bool = False

    @property
    def n(self) -> int:
        """Sequences per input (``n``): input ``i``'s sequence ``j`` is choice ``i * n + j``."""
        n = self.options.get("n", 1)
        return n if isinstance(n, int) and not isinstance(n, bool) else 1


def parse_request(kind: str, body: Any, served_model: str) -> GenerationJob:
    """The job for a decoded body of ``/v1/completions`` (``kind`` COMPLETION) or
    ``/v1/chat/completions`` (CHAT); :class:`ApiError` (400, 404) naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - _KNOWN[kind])
    if unknown:
        raise bad_field(unknown[0], f"unrecognized request field(s): {', '.join(map(repr, unknown))}")
    _check_model(body.get("model"), served_model)
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
    ignored = tuple(sorted(n for n in body if FIELDS[n].how == IGNORED and body[n] is not None))
    return GenerationJob(
        kind,
        inputs,
        options,
        stream,
        include_usage,
        ignored,
        echo=_echo(body, kind),
        return_token_ids=_flag(body, "return_token_ids"),
        continuous_usage=continuous_usage,
    )


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
    a scalar, or for ``stop`` / ``stop_token_ids`` an array of strings / integers. Anything
    else is refused here, naming the field, to keep the module's size invariant (and msgpack
    cannot carry integers past 64 bits)."""
    if isinstance(value, (str, bool, float)) or _is_int(value):
        return value
    if name == "chat_template_kwargs" and isinstance(value, dict):
        try:
            size = len(msgpack.packb(value))
        except (TypeError, ValueError, OverflowError):
            raise bad_field(name, "'chat_template_kwargs' holds a value msgpack cannot carry (an integer past 64 bits)") from None
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise bad_field(name, f"'chat_template_kwargs' exceeds {MAX_TEMPLATE_KWARGS_BYTES} bytes packed")
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
    if name == "chat_template_kwargs":
        raise bad_field(name, f"'chat_template_kwargs' must be an object, got {_json_type(value)}")
    kind = "boolean" if name in _BOOLEAN_FIELDS else "number"
    raise bad_field(name, f"'{name}' must be a {kind}, got {_json_type(value)}")


_BOOLEAN_FIELDS = frozenset(
    {"ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "add_generation_prompt", "continue_final_message"}
)


def _check_model(model: Any, served_model: str) -> None:
    if model is None:
        raise bad_field("model", "'model' is required")
    if not isinstance(model, str):
        raise bad_field("model", f"'model' must be a string, got {_json_type(model)}")
    if model != served_model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_model}'", param="model", code="model_not_found")


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
