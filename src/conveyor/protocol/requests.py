"""The client requests: a decoded client map parsed into a validated request or command.

Validation is total: anything a client can send either parses into a
:class:`GenerateRequest` / :class:`AbortCommand` / :class:`StatsCommand` /
:class:`ProfileCommand` / :class:`MetricsCommand` / :class:`LoraCommand` or raises
:class:`~conveyor.protocol.wire.ProtocolError` whose message names the offending field. A
generate request is validated in two steps: :func:`parse_client_message` checks every field
of the map here (its sampling fields in :mod:`conveyor.protocol.sampling_fields`), and
:func:`conveyor.protocol.validation.check_tokenized` what needs the tokenized prompt and the
model (vocabulary, model length) once the frontend has it. The frontend and conveyor.client
both use these field names, so they cannot drift apart.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from conveyor.ipc.messages import SamplingParams
from conveyor.protocol.limits import (
    DEFAULT_PROFILE_WINDOW_S,
    MAX_LORA_NAME_LEN,
    MAX_LORA_PATH_LEN,
    MAX_N,
    MAX_PRIORITY,
    MAX_PROFILE_SERIES,
    MAX_PROFILE_WINDOW_S,
    MAX_REQUEST_ID_LEN,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_TEMPLATE_KWARGS_BYTES,
)
from conveyor.protocol.rl_commands import RL_FIELDS, EngineCommand, parse_rl_command
from conveyor.protocol.sampling_fields import LOGPROBS_FIELDS, SAMPLING_FIELDS, parse_sampling
from conveyor.protocol.token_commands import DetokenizeCommand, TokenizeCommand, parse_detokenize, parse_tokenize
from conveyor.protocol.validation import is_int, is_number
from conveyor.protocol.wire import (
    ABORT,
    CLIENT_PROTOCOL_VERSION,
    COMMANDS,
    DETOKENIZE,
    GENERATE,
    INVALID_INPUT,
    LOAD_LORA,
    METRICS,
    PROFILE,
    STATS,
    TOKENIZE,
    UNKNOWN_TYPE,
    UNLOAD_LORA,
    UNSUPPORTED_VERSION,
    CommandError,
    ProtocolError,
    pack,
)
from conveyor.structured.constraint import Constraint, ConstraintError
from conveyor.structured.tool_choice import tool_choice_constraint

# Generate fields the frontend applies itself (input preparation and output text), never
# seen by the scheduler or the worker: see :class:`GenerateRequest`.
FRONTEND_FIELDS = (
    "fill_context",
    "truncate_prompt_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "return_prompt_token_ids",
)
# Structured output (docs/structured-output.md): ``constraint`` (the output must match it),
# ``tools`` (rendered by the chat template) and ``tool_choice`` ("required" or a named
# function: enforced as a JSON-schema constraint over ``tools``).
STRUCTURED_FIELDS = ("constraint", "tools", "tool_choice")
# Generate fields besides the input, the id and stream that clients pass as keyword arguments.
OPTION_FIELDS = (
    *SAMPLING_FIELDS,
    "best_of",
    *LOGPROBS_FIELDS,
    "stop",
    "priority",
    "lora",
    *FRONTEND_FIELDS,
    *STRUCTURED_FIELDS,
)
GENERATE_FIELDS = frozenset({"type", "v", "request_id", "prompt", "messages", "token_ids", "stream", *OPTION_FIELDS})
# Template variables the frontend sets itself, so not settable through ``chat_template_kwargs``.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
PROFILE_FIELDS = frozenset({"type", "v", "window_s", "trace", "series"})
METRICS_FIELDS = frozenset({"type", "v"})
LORA_FIELDS = {
    LOAD_LORA: frozenset({"type", "v", "request_id", "lora_name", "lora_path"}),
    UNLOAD_LORA: frozenset({"type", "v", "request_id", "lora_name"}),
}


@dataclass
class GenerateRequest:
    """A validated generate request, before tokenization. Exactly one input is set.

    ``priority``: higher is served sooner when the server runs the ``priority`` policy.
    ``lora``: the LoRA adapter to generate with (a name the server registered, e.g. with
    ``--lora-modules``; an unknown one fails the request); None: the base model.

    The frontend fields (:data:`FRONTEND_FIELDS`, applied where the input is prepared and the
    output detokenized, :mod:`conveyor.frontend.inputs`): ``fill_context`` without a
    ``max_tokens`` lets the request run to the model length (``max_tokens`` becomes the room
    the tokenized prompt leaves; OpenAI's chat default); ``truncate_prompt_tokens`` keeps the
    input's last k tokens; ``skip_special_tokens`` drops special tokens from the text;
    ``include_stop_str_in_output`` keeps the matched stop string at the end of the text;
    ``add_generation_prompt`` (None: True unless ``continue_final_message``),
    ``continue_final_message`` (the last message is left open for the model to continue) and
    ``chat_template_kwargs`` (extra template variables) apply to ``messages`` only.
    """

    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    priority: int = 0
    lora: str | None = None
    fill_context: bool = False
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_prompt_token_ids: bool = False  # the final carries the prompt's ids (prompt_token_ids)
    # best_of > n: the scheduler runs ``sampling.n`` (= best_of) sequences, each with its
    # sampled tokens' log-probabilities (``sampling.logprobs``: the client's k, else 0), and the
    # ``keep_best`` (the client's n) with the highest cumulative log-probability are returned,
    # best first. ``ranking_logprobs``: the client did not ask for them (kept, never sent).
    keep_best: int | None = None
    ranking_logprobs: bool = False
    # Structured output: what the output must match (compiled by the frontend, which then sets
    # ``sampling.grammar``), and the tools the chat template is given.
    constraint: Constraint | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class StatsCommand:
    """Ask for the server's block pool, queues and counters; ``iterations`` adds the log of
    the recent iterations (up to 256 maps, so it is left out unless asked for)."""

    iterations: bool = False


@dataclass
class ProfileCommand:
    """Ask every process for its latency profile over the last ``window_s`` seconds."""

    window_s: float = DEFAULT_PROFILE_WINDOW_S
    trace: bool = False
    series: list[str] = field(default_factory=list)


@dataclass
class MetricsCommand:
    """Ask the frontend for its request-level counters and latency histograms (the reply:
    :func:`conveyor.protocol.replies.metrics_reply`); it has no fields."""


@dataclass
class LoraCommand:
    """Load the PEFT adapter in ``path`` as ``name`` (``load_lora``), or unload ``name``
    (``unload_lora``: ``path`` None). ``request_id`` routes the answer."""

    request_id: str
    name: str
    path: str | None = None


ClientMessage = (
    GenerateRequest
    | AbortCommand
    | StatsCommand
    | ProfileCommand
    | MetricsCommand
    | LoraCommand
    | EngineCommand
    | TokenizeCommand
    | DetokenizeCommand
)


def parse_client_message(obj: dict[str, Any]) -> ClientMessage:
    """Validate a decoded client map. Raises ProtocolError naming the problem (and, for a
    ``stats``/``profile``/``metrics``, the command it refuses)."""
    try:
        return _parse_client_message(obj)
    except ProtocolError as exc:
        kind = obj.get("type")
        if isinstance(kind, str) and kind in COMMANDS:
            exc.command = kind
        raise


def _parse_client_message(obj: dict[str, Any]) -> ClientMessage:
    rid = obj.get("request_id")
    rid_for_error = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LEN else None
    kind = obj.get("type")
    version = obj.get("v", CLIENT_PROTOCOL_VERSION)
    if not is_int(version) or version != CLIENT_PROTOCOL_VERSION:  # an int: true and 1.0 are no version
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this server speaks {CLIENT_PROTOCOL_VERSION})",
            rid_for_error,
            UNSUPPORTED_VERSION,
        )
    if kind == GENERATE:
        return _parse_generate(obj, rid_for_error)
    if kind == ABORT:
        if rid_for_error is None:
            raise ProtocolError("abort needs 'request_id': a non-empty string")
        return AbortCommand(rid_for_error)
    if kind == STATS:
        iterations = obj.get("iterations")
        if iterations is not None and not isinstance(iterations, bool):
            raise ProtocolError("'iterations' must be a boolean")
        return StatsCommand(iterations=bool(iterations))
    if kind == PROFILE:
        return _parse_profile(obj)
    if isinstance(kind, str) and kind in LORA_FIELDS:  # a type may be any value: a list is unhashable
        return _parse_lora(obj, kind, rid_for_error)
    if isinstance(kind, str) and kind in RL_FIELDS:
        return parse_rl_command(obj, kind)
    if kind == TOKENIZE:
        return parse_tokenize(obj, _parse_client_message)
    if kind == DETOKENIZE:
        return parse_detokenize(obj)
    if kind == METRICS:
        unknown = set(obj) - METRICS_FIELDS
        if unknown:
            raise ProtocolError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
        return MetricsCommand()
    if "type" not in obj:
        raise ProtocolError("missing field 'type'", rid_for_error, UNKNOWN_TYPE)
    raise ProtocolError(f"unknown message type {kind!r}", rid_for_error, UNKNOWN_TYPE)


def _parse_lora(obj: dict[str, Any], kind: str, rid: str | None) -> LoraCommand:
    unknown = set(obj) - LORA_FIELDS[kind]
    if unknown:
        raise CommandError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}", rid)
    if rid is None:
        raise CommandError(f"{kind} needs 'request_id': a non-empty string of at most {MAX_REQUEST_ID_LEN} characters")
    name, path = obj.get("lora_name"), obj.get("lora_path")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME_LEN:
        raise CommandError(f"'lora_name' must be a non-empty string of at most {MAX_LORA_NAME_LEN} characters", rid)
    if kind == UNLOAD_LORA:
        return LoraCommand(rid, name)
    if not isinstance(path, str) or not 0 < len(path) <= MAX_LORA_PATH_LEN:
        raise CommandError(
            f"'lora_path' must be a directory: a non-empty string of at most {MAX_LORA_PATH_LEN} characters", rid
        )
    return LoraCommand(rid, name, path)


def _parse_profile(obj: dict[str, Any]) -> ProfileCommand:
    unknown = set(obj) - PROFILE_FIELDS
    if unknown:
        raise ProtocolError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    window = obj.get("window_s")
    window = DEFAULT_PROFILE_WINDOW_S if window is None else window
    if not is_number(window) or not 0 < window <= MAX_PROFILE_WINDOW_S:
        raise ProtocolError(f"'window_s' must be a number in (0, {MAX_PROFILE_WINDOW_S:g}], got {window!r}")
    trace = obj.get("trace")
    trace = False if trace is None else trace
    if not isinstance(trace, bool):
        raise ProtocolError("'trace' must be a boolean")
    series = obj.get("series")
    series = [] if series is None else series
    if (
        not isinstance(series, list)
        or len(series) > MAX_PROFILE_SERIES
        or not all(isinstance(s, str) and 0 < len(s) <= 64 for s in series)
    ):
        raise ProtocolError(f"'series' must be an array of at most {MAX_PROFILE_SERIES} names")
    return ProfileCommand(float(window), trace, list(series))


def _parse_generate(obj: dict[str, Any], rid: str | None) -> GenerateRequest:
    """A refusal names the id the message carried (``rid``, None when it had none): an id
    assigned here is the accepted request's, never one the client is told it sent."""

    def fail(msg: str) -> ProtocolError:
        return ProtocolError(msg, rid)

    unknown = set(obj) - GENERATE_FIELDS
    if unknown:
        raise fail(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    if "request_id" in obj and obj["request_id"] is not None:
        if rid is None:
            raise fail(f"'request_id' must be a non-empty string of at most {MAX_REQUEST_ID_LEN} characters")
        request_id = rid
    else:
        request_id = uuid.uuid4().hex

    inputs = [k for k in ("prompt", "messages", "token_ids") if obj.get(k) is not None]
    if len(inputs) != 1:
        raise fail(
            "exactly one of 'prompt', 'messages' or 'token_ids' is required"
            + (f" (got {', '.join(inputs)})" if inputs else "")
        )
    req = GenerateRequest(request_id=request_id, sampling=SamplingParams())
    _parse_input(obj, inputs[0], req, fail, rid)
    _parse_request_options(obj, req, fail)
    req.sampling = parse_sampling(obj, rid)
    _parse_frontend_fields(obj, req, fail)
    _parse_structured_fields(obj, req, fail)
    _parse_best_of(obj, req, fail)
    return req


def _parse_input(obj: dict[str, Any], kind: str, req: GenerateRequest, fail: Any, rid: str | None) -> None:
    """The request's one input (``kind``: ``prompt``, ``messages`` or ``token_ids``) into ``req``."""
    if kind == "prompt":
        if not isinstance(obj["prompt"], str):
            raise fail(f"'prompt' must be a string, got {type(obj['prompt']).__name__}")
        if not obj["prompt"]:
            raise ProtocolError("'prompt' is empty", rid, INVALID_INPUT)
        req.prompt = obj["prompt"]
    elif kind == "messages":
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise fail("'messages' must be a non-empty array of {role, content} maps")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise fail(f"'messages'[{i}] must be a map with string 'role' and 'content'")
            # An assistant turn that called tools may have no content (OpenAI sends null).
            if not isinstance(m.get("content"), str) and not (m.get("content") is None and m.get("tool_calls")):
                raise fail(f"'messages'[{i}] must be a map with string 'role' and 'content'")
        req.messages = msgs
    else:
        ids = obj["token_ids"]
        if not isinstance(ids, list) or not ids:
            raise fail("'token_ids' must be a non-empty array of integers")
        if not all(is_int(t) for t in ids):
            raise fail("'token_ids' must contain only integers")
        req.token_ids = ids


def _parse_request_options(obj: dict[str, Any], req: GenerateRequest, fail: Any) -> None:
    """``stream``, ``stop``, ``priority`` and ``lora`` into ``req``."""
    stream = obj.get("stream")
    stream = False if stream is None else stream  # null is the default, as for every optional field
    if not isinstance(stream, bool):
        raise fail("'stream' must be a boolean")
    req.stream = stream
    stop = obj.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise fail("'stop' must be a non-empty string or an array of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_LEN for s in stop):
        raise fail(f"'stop' allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_LEN} characters")
    req.stop = stop
    priority = obj.get("priority")
    if priority is not None:
        if not is_int(priority) or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise fail(f"'priority' must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
        req.priority = priority
    lora = obj.get("lora")
    if lora is not None:
        if not isinstance(lora, str) or not 0 < len(lora) <= MAX_LORA_NAME_LEN:
            raise fail(f"'lora' must be an adapter name: a non-empty string of at most {MAX_LORA_NAME_LEN} characters")
        req.lora = lora


def _parse_best_of(obj: dict[str, Any], req: GenerateRequest, fail: Any) -> None:
    """``best_of`` > n: ``best_of`` sequences run, the ``n`` most likely are kept."""
    best_of = obj.get("best_of")
    if best_of is None:
        return
    n = req.sampling.n
    if not is_int(best_of) or not n <= best_of <= MAX_N:
        raise fail(f"'best_of' must be an integer in [n, {MAX_N}] (n is {n}), got {best_of!r}")
    if best_of > n:
        if req.stream:
            raise fail("'best_of' > n is not supported with streaming (the best are known only at the end)")
        req.keep_best = n
        req.ranking_logprobs = req.sampling.logprobs is None
        req.sampling = msgspec.structs.replace(req.sampling, n=best_of, logprobs=req.sampling.logprobs or 0)


def _parse_structured_fields(obj: dict[str, Any], req: GenerateRequest, fail: Any) -> None:
    """``constraint``, ``tools`` and ``tool_choice`` into ``req.constraint`` / ``req.tools``:
    shapes and sizes only (whether a schema, regex or grammar is valid is the compile's to
    say, in the frontend, before the request is scheduled)."""
    tools, tool_choice = obj.get("tools"), obj.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise fail("'tools' must be an array of {type: function, function: {name, parameters}} maps")
        if req.messages is None:
            raise fail("'tools' applies to 'messages' only")
        req.tools = tools
    try:
        forced = tool_choice_constraint(tools or [], tool_choice)
    except ConstraintError as exc:
        raise fail(f"'tool_choice': {exc}") from None
    if obj.get("constraint") is not None:
        try:
            req.constraint = parse_constraint(obj["constraint"])
        except ConstraintError as exc:
            raise fail(str(exc)) from None
    if forced is not None:
        if req.constraint is not None:
            raise fail("'constraint' and a 'tool_choice' that forces a call cannot both be given")
        req.constraint = forced


def parse_constraint(value: Any) -> Constraint:
    """A ``constraint`` map (docs/protocol.md) as a :class:`Constraint`; ConstraintError naming
    what is wrong."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConstraintError("'constraint' must be a map with a string 'type'")
    kind = value["type"]
    keys = {
        "json_schema": {"schema", "strict"},
        "json_object": set(),
        "regex": {"pattern"},
        "choice": {"choices"},
        "grammar": {"grammar"},
    }
    if kind not in keys:
        raise ConstraintError(f"'constraint'.type must be one of {', '.join(keys)}, got {kind!r}")
    unknown = set(value) - keys[kind] - {"type"}
    if unknown:
        raise ConstraintError(
            f"'constraint' of type {kind} has unknown field(s): {', '.join(sorted(map(str, unknown)))}"
        )
    try:
        if kind == "json_schema":
            strict = value.get("strict", True)
            if not isinstance(strict, bool):
                raise ConstraintError("json_schema: 'strict' must be a boolean")
            return Constraint.json_schema(value.get("schema"), strict=strict)
        if kind == "json_object":
            return Constraint.json_object()
        if kind == "regex":
            return Constraint.regex(value.get("pattern"))
        if kind == "choice":
            return Constraint.choice(value.get("choices"))
        return Constraint.grammar(value.get("grammar"))
    except ConstraintError as exc:
        raise ConstraintError(f"'constraint': {exc}") from None


def _parse_frontend_fields(obj: dict[str, Any], req: GenerateRequest, fail: Any) -> None:
    """The :data:`FRONTEND_FIELDS` of a generate map into ``req``, each checked."""
    flags = {}
    for name in (
        "fill_context",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "add_generation_prompt",
        "continue_final_message",
        "return_prompt_token_ids",
    ):
        value = obj.get(name)
        if value is not None and not isinstance(value, bool):
            raise fail(f"'{name}' must be a boolean, got {value!r}")
        flags[name] = value
    truncate = obj.get("truncate_prompt_tokens")
    if truncate is not None and (not is_int(truncate) or truncate < 1):
        raise fail(f"'truncate_prompt_tokens' must be an integer >= 1, got {truncate!r}")
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise fail("'chat_template_kwargs' must be a map with string keys")
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
        if reserved:
            raise fail(f"'chat_template_kwargs' may not set {', '.join(reserved)}: the request's own fields do")
        if len(pack(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise fail(f"'chat_template_kwargs' exceeds {MAX_TEMPLATE_KWARGS_BYTES} bytes packed")
    chat_only = [n for n in ("add_generation_prompt", "continue_final_message") if flags[n] is not None]
    if kwargs is not None:
        chat_only.append("chat_template_kwargs")
    if chat_only and req.messages is None:
        raise fail(f"'{chat_only[0]}' applies to 'messages' only")
    if flags["continue_final_message"] and flags["add_generation_prompt"]:
        raise fail("'continue_final_message' and 'add_generation_prompt' cannot both be true")
    req.fill_context = bool(flags["fill_context"]) and obj.get("max_tokens") is None
    req.truncate_prompt_tokens = truncate
    req.skip_special_tokens = flags["skip_special_tokens"] is not False
    req.include_stop_str_in_output = bool(flags["include_stop_str_in_output"])
    req.continue_final_message = bool(flags["continue_final_message"])
    req.add_generation_prompt = (
        not req.continue_final_message if flags["add_generation_prompt"] is None else flags["add_generation_prompt"]
    )
    req.chat_template_kwargs = dict(kwargs or {})
    req.return_prompt_token_ids = bool(flags["return_prompt_token_ids"])
