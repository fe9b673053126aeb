"""The client-facing wire protocol: msgpack maps between clients and the frontend.

Maps with named fields (not the positional arrays of internal messages) so a
client in any language can be written from docs/protocol.md alone. Every map
has ``type`` and ``v`` (the protocol version). This module owns the field names
and the validation of incoming requests; the frontend and conveyor.client both
use it, so they cannot drift apart.

Validation is total: anything a client can send either parses into a
:class:`GenerateRequest` / :class:`AbortCommand` / :class:`StatsCommand` /
:class:`ProfileCommand` / :class:`MetricsCommand` or
raises :class:`ProtocolError` whose message names the offending field. A generate request
is validated in two steps, both here: :func:`parse_client_message` checks every field of the
map, :func:`check_tokenized` what needs the tokenized prompt and the model (vocabulary, model
length) once the frontend has it. The worker does not repeat these rules: it checks only that
each plan agrees with its own state (:mod:`conveyor.worker.plan_check`, its trust boundary).
The scheduler applies :func:`context_problem` once more at its own entry, because it also
takes requests from in-process callers that never pass the frontend (the engine, tests);
for a request from the frontend that check always passes.
The replies the server sends are built in :mod:`conveyor.protocol.replies`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec

from conveyor.ipc.messages import MAX_LOGIT_BIAS, SamplingParams
from conveyor.structured.constraint import Constraint, ConstraintError
from conveyor.structured.tool_choice import tool_choice_constraint

CLIENT_PROTOCOL_VERSION = 1
MAX_CLIENT_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
# Decode limits of a client frame (:func:`unpack_map`), besides its size: they bound the
# objects one frame can make (a valid request needs far less: an array is at most a prompt's
# token ids, a map a request's fields). Nesting deeper than msgpack's own stack (1024
# levels) is refused by the decoder itself.
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 256
MAX_EXT_LEN = 64
# How much of an undecodable frame is read for its request id (:func:`recover_request_id`).
RECOVER_SCAN_BYTES = 1 << 20
RECOVER_SCAN_KEYS = 64

# Error codes: the ``code`` of an ``error`` map or of an error ``final``, what a client can
# act on (the text beside it says what exactly was wrong).
MALFORMED = "malformed"  # not msgpack (truncated, invalid UTF-8, trailing bytes) or not a map
TOO_LARGE = "too_large"  # over the message size or a decode limit (length, nesting)
BAD_FRAMES = "bad_frames"  # a message of more than one frame, or an empty one
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_TYPE = "unknown_type"  # missing or unknown ``type``
INVALID_FIELD = "invalid_field"  # an unknown field, or a field of the wrong type or range
INVALID_INPUT = "invalid_input"  # an input the model cannot take: empty, ids outside the vocabulary, a template error
PROMPT_TOO_LONG = "prompt_too_long"  # the prompt (or prompt + max_tokens) does not fit the model length
DUPLICATE_REQUEST_ID = "duplicate_request_id"  # the client already has a request in flight under this id
OVERLOADED = "overloaded"  # refused by the scheduler's bounded queue: retry later
TIMEOUT = "timeout"  # waited longer than --max-queue-time: retry later
SERVER_ERROR = "server_error"  # the server failed the request: a process died, shutdown, an internal error

# Message types, client -> server
GENERATE = "generate"
ABORT = "abort"
STATS = "stats"
PROFILE = "profile"
METRICS = "metrics"
# Message types, server -> client
DELTA = "delta"
FINAL = "final"
ERROR = "error"
STATS_REPLY = "stats"
PROFILE_REPLY = "profile"
METRICS_REPLY = "metrics"

# Most sequences one request may ask for (``n``): each is a sequence at the scheduler, with a
# detokenizer and stop strings of its own in the frontend, so one message must not fan out
# without bound. Each sequence must fit the KV pool on its own (the scheduler's check), and
# they run side by side as the pool and --max-num-seqs allow.
MAX_N = 64
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "n",
)
# Log-probabilities asked for (None: none; k: the token's own and the k most likely), bounded
# by the server's max_logprobs (:func:`logprobs_problem`).
LOGPROBS_FIELDS = ("logprobs", "prompt_logprobs")
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
)
# Structured output (docs/structured-output.md): ``constraint`` (the output must match it),
# ``tools`` (rendered by the chat template) and ``tool_choice`` ("required" or a named
# function: enforced as a JSON-schema constraint over ``tools``).
STRUCTURED_FIELDS = ("constraint", "tools", "tool_choice")
# Generate fields besides the input, the id and stream that clients pass as keyword arguments.
OPTION_FIELDS = (*SAMPLING_FIELDS, "best_of", *LOGPROBS_FIELDS, "stop", "priority", "lora", *FRONTEND_FIELDS, *STRUCTURED_FIELDS)
GENERATE_FIELDS = frozenset({"type", "v", "request_id", "prompt", "messages", "token_ids", "stream", *OPTION_FIELDS})
MAX_PRIORITY = 2**31 - 1  # |priority| bound: any int32
MAX_LORA_NAME_LEN = 256  # length bound of a LoRA adapter's name
# Seeds: any 64-bit integer, signed or unsigned, is accepted and stored as the signed 64-bit
# value with the same bit pattern (the sampler keys its draws by those 64 bits).
MIN_SEED = -(2**63)
SEED_END = 2**64
# The packed size bound of ``chat_template_kwargs`` (its values reach the template as they are).
MAX_TEMPLATE_KWARGS_BYTES = 32 * 1024
# Template variables the frontend sets itself, so not settable through ``chat_template_kwargs``.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


class ProtocolError(ValueError):
    """A client message that cannot be served; ``request_id`` is set when it was readable,
    ``code`` is one of the error codes above."""

    def __init__(self, message: str, request_id: str | None = None, code: str = INVALID_FIELD) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code


class FrameError(ProtocolError):
    """A frame that is not a readable map (:func:`unpack_map`), or a message of the wrong
    frames: it started no request, so it is answered with an ``error`` map, never a
    ``final``; ``request_id`` is what :func:`recover_request_id` could read from it."""


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
    # best_of > n: the scheduler runs ``sampling.n`` (= best_of) sequences, each with its
    # sampled tokens' log-probabilities (``sampling.logprobs`` 0), and the ``keep_best`` (the
    # client's n) with the highest cumulative log-probability are returned, best first.
    keep_best: int | None = None
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


PROFILE_FIELDS = frozenset({"type", "v", "window_s", "trace", "series"})
DEFAULT_PROFILE_WINDOW_S = 60.0
MAX_PROFILE_WINDOW_S = 3600.0
MAX_PROFILE_SERIES = 32


@dataclass
class ProfileCommand:
    """Ask every process for its latency profile over the last ``window_s`` seconds."""

    window_s: float = DEFAULT_PROFILE_WINDOW_S
    trace: bool = False
    series: list[str] = field(default_factory=list)


METRICS_FIELDS = frozenset({"type", "v"})


@dataclass
class MetricsCommand:
    """Ask the frontend for its request-level counters and latency histograms (the reply:
    :func:`conveyor.protocol.replies.metrics_reply`); it has no fields."""


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_map(data: bytes | memoryview) -> dict[str, Any]:
    """Decode one client frame into a map, within the size and decode limits above;
    :class:`FrameError` (carrying the request id it could still read) for anything else."""
    if not len(data):
        raise FrameError("empty message: a message is one frame holding a msgpack map", None, BAD_FRAMES)
    if len(data) > MAX_CLIENT_MESSAGE_BYTES:
        raise FrameError(
            f"message of {len(data)} bytes exceeds the limit of {MAX_CLIENT_MESSAGE_BYTES}",
            recover_request_id(data),
            TOO_LARGE,
        )
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=MAX_EXT_LEN,
        )
    except msgpack.StackError:
        raise FrameError("malformed msgpack: nested too deeply", recover_request_id(data), TOO_LARGE) from None
    except Exception as exc:  # msgpack raises several unrelated exception types, some without text
        # A length over a limit is a ValueError "... exceeds max_array_len(...)"; the rest
        # (invalid UTF-8, trailing bytes, truncation, reserved bytes) are malformed frames.
        text = str(exc) or type(exc).__name__
        code = TOO_LARGE if isinstance(exc, ValueError) and "exceeds max_" in text else MALFORMED
        raise FrameError(f"malformed msgpack: {text}", recover_request_id(data), code) from None
    if not isinstance(obj, dict):
        raise FrameError(f"message must be a map, got {type(obj).__name__}", None, MALFORMED)
    return obj


def recover_request_id(data: bytes | memoryview) -> str | None:
    """The ``request_id`` of a frame that does not decode as a whole, when it can still be
    read: the frame starts with a map, and among its first :data:`RECOVER_SCAN_KEYS` entries
    (within its first :data:`RECOVER_SCAN_BYTES` bytes) one is ``request_id`` with a valid
    id as its value; every entry before it is skipped undecoded (so invalid UTF-8, a bad
    length or deep nesting elsewhere, or a truncation after it, does not hide it). None
    otherwise. Bounded work: a prefix of the frame, a few keys, C-speed skips."""
    unpacker = msgpack.Unpacker(
        raw=True,
        max_buffer_size=RECOVER_SCAN_BYTES,
        max_array_len=MAX_ARRAY_LEN,
        max_map_len=MAX_MAP_LEN,
        max_ext_len=MAX_EXT_LEN,
    )
    try:
        unpacker.feed(memoryview(data)[:RECOVER_SCAN_BYTES])
        for _ in range(min(unpacker.read_map_header(), RECOVER_SCAN_KEYS)):
            if unpacker.unpack() != b"request_id":
                unpacker.skip()
                continue
            value = unpacker.unpack()
            if not isinstance(value, bytes):
                return None
            rid = value.decode("utf-8")
            return rid if 0 < len(rid) <= MAX_REQUEST_ID_LEN else None
    except Exception:  # whatever the frame holds: it had no readable id before the problem
        return None
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def parse_client_message(
    obj: dict[str, Any],
) -> GenerateRequest | AbortCommand | StatsCommand | ProfileCommand | MetricsCommand:
    """Validate a decoded client map. Raises ProtocolError naming the problem."""
    rid = obj.get("request_id")
    rid_for_error = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_LEN else None
    kind = obj.get("type")
    version = obj.get("v", CLIENT_PROTOCOL_VERSION)
    if not _is_int(version) or version != CLIENT_PROTOCOL_VERSION:  # an int: true and 1.0 are no version
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
    if kind == METRICS:
        unknown = set(obj) - METRICS_FIELDS
        if unknown:
            raise ProtocolError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
        return MetricsCommand()
    if "type" not in obj:
        raise ProtocolError("missing field 'type'", rid_for_error, UNKNOWN_TYPE)
    raise ProtocolError(f"unknown message type {kind!r}", rid_for_error, UNKNOWN_TYPE)


def _parse_profile(obj: dict[str, Any]) -> ProfileCommand:
    unknown = set(obj) - PROFILE_FIELDS
    if unknown:
        raise ProtocolError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    window = obj.get("window_s")
    window = DEFAULT_PROFILE_WINDOW_S if window is None else window
    if not _is_number(window) or not 0 < window <= MAX_PROFILE_WINDOW_S:
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

    if "prompt" in inputs:
        if not isinstance(obj["prompt"], str):
            raise fail(f"'prompt' must be a string, got {type(obj['prompt']).__name__}")
        if not obj["prompt"]:
            raise ProtocolError("'prompt' is empty", rid, INVALID_INPUT)
        req.prompt = obj["prompt"]
    elif "messages" in inputs:
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
        if not all(_is_int(t) for t in ids):
            raise fail("'token_ids' must contain only integers")
        req.token_ids = ids

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
        if not _is_int(priority) or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise fail(f"'priority' must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
        req.priority = priority
    lora = obj.get("lora")
    if lora is not None:
        if not isinstance(lora, str) or not 0 < len(lora) <= MAX_LORA_NAME_LEN:
            raise fail(f"'lora' must be an adapter name: a non-empty string of at most {MAX_LORA_NAME_LEN} characters")
        req.lora = lora
    req.sampling = parse_sampling(obj, rid)
    _parse_frontend_fields(obj, req, fail)
    _parse_structured_fields(obj, req, fail)
    best_of = obj.get("best_of")
    if best_of is not None:
        n = req.sampling.n
        if not _is_int(best_of) or not n <= best_of <= MAX_N:
            raise fail(f"'best_of' must be an integer in [n, {MAX_N}] (n is {n}), got {best_of!r}")
        if best_of > n:
            if req.stream:
                raise fail("'best_of' > n is not supported with streaming (the best are known only at the end)")
            req.keep_best = n
            req.sampling = msgspec.structs.replace(req.sampling, n=best_of, logprobs=0)
    if req.sampling.n > 1:
        # Not yet per sequence: log-probabilities (one log per request in the frontend) and
        # constraints (one grammar state per request); refused rather than answered wrongly.
        asked = [name for name in ("logprobs", "prompt_logprobs", "constraint", "tools") if obj.get(name) is not None]
        if req.constraint is not None and "constraint" not in asked:
            asked.append("tool_choice")
        if asked:
            raise fail(f"'{asked[0]}' is not supported with n > 1 yet")
    return req


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
    keys = {"json_schema": {"schema", "strict"}, "json_object": set(), "regex": {"pattern"}, "choice": {"choices"}, "grammar": {"grammar"}}
    if kind not in keys:
        raise ConstraintError(f"'constraint'.type must be one of {', '.join(keys)}, got {kind!r}")
    unknown = set(value) - keys[kind] - {"type"}
    if unknown:
        raise ConstraintError(f"'constraint' of type {kind} has unknown field(s): {', '.join(sorted(map(str, unknown)))}")
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
    for name in ("fill_context", "skip_special_tokens", "include_stop_str_in_output", "add_generation_prompt", "continue_final_message"):
        value = obj.get(name)
        if value is not None and not isinstance(value, bool):
            raise fail(f"'{name}' must be a boolean, got {value!r}")
        flags[name] = value
    truncate = obj.get("truncate_prompt_tokens")
    if truncate is not None and (not _is_int(truncate) or truncate < 1):
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
    req.add_generation_prompt = not req.continue_final_message if flags["add_generation_prompt"] is None else flags["add_generation_prompt"]
    req.chat_template_kwargs = dict(kwargs or {})


def parse_sampling(obj: dict[str, Any], request_id: str | None = None) -> SamplingParams:
    """Sampling fields of a generate map, each checked for type and range."""

    def get(name: str, default: Any) -> Any:
        value = obj.get(name)
        return default if value is None else value

    def fail(msg: str) -> ProtocolError:
        return ProtocolError(msg, request_id)

    max_tokens = get("max_tokens", 16)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise fail(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    temperature = get("temperature", 1.0)
    if not _is_number(temperature) or temperature < 0:
        raise fail(f"'temperature' must be a number >= 0, got {temperature!r}")
    top_p = get("top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise fail(f"'top_p' must be in (0, 1], got {top_p!r}")
    top_k = get("top_k", 0)
    if not _is_int(top_k) or top_k < 0:
        raise fail(f"'top_k' must be an integer >= 0 (0 disables it), got {top_k!r}")
    min_p = get("min_p", 0.0)
    if not _is_number(min_p) or not 0 <= min_p <= 1:
        raise fail(f"'min_p' must be in [0, 1], got {min_p!r}")
    seed = obj.get("seed")
    if seed is not None:
        if not _is_int(seed) or not MIN_SEED <= seed < SEED_END:
            raise fail(f"'seed' must be a 64-bit integer, in [-2**63, 2**64), got {seed!r}")
        seed = signed_seed(seed)
    stop_token_ids = get("stop_token_ids", [])
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_token_ids):
        raise fail("'stop_token_ids' must be an array of non-negative integers")
    ignore_eos = get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise fail("'ignore_eos' must be a boolean")
    n = get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise fail(f"'n' must be an integer in [1, {MAX_N}], got {n!r}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = get(name, 0.0)
        if not _is_number(value) or not -2 <= value <= 2:
            raise fail(f"'{name}' must be in [-2, 2], got {value!r}")
        penalties[name] = float(value)
    repetition_penalty = get("repetition_penalty", 1.0)
    if not _is_number(repetition_penalty) or not 0 < repetition_penalty < math.inf:
        raise fail(f"'repetition_penalty' must be a number > 0, got {repetition_penalty!r}")
    min_tokens = get("min_tokens", 0)
    if not _is_int(min_tokens) or min_tokens < 0:  # (and at most max_tokens: context_problem)
        raise fail(f"'min_tokens' must be an integer >= 0, got {min_tokens!r}")
    logit_bias = _parse_logit_bias(get("logit_bias", {}), fail)
    for name in LOGPROBS_FIELDS:
        value = obj.get(name)
        if value is not None and (not _is_int(value) or value < 0):
            raise fail(f"'{name}' must be an integer >= 0 (the number of top log-probabilities), got {value!r}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(min_p),
        seed=seed,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        n=n,
        repetition_penalty=float(repetition_penalty),
        min_tokens=min_tokens,
        logit_bias=logit_bias,
        **penalties,
        logprobs=obj.get("logprobs"),
        prompt_logprobs=obj.get("prompt_logprobs"),
    )


def _parse_logit_bias(value: Any, fail: Any) -> dict[int, float]:
    """``logit_bias``: a map of token id (an integer, or its decimal string: JSON's keys are
    strings) to a bias in [-100, 100], at most :data:`MAX_LOGIT_BIAS` entries. The ids are
    checked against the vocabulary with the context (:func:`context_problem`)."""
    if not isinstance(value, dict):
        raise fail("'logit_bias' must be a map of token id to bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise fail(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    bias = {}
    for key, number in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not _is_int(token) or token < 0:
            raise fail(f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}")
        if not _is_number(number) or not -100 <= number <= 100:
            raise fail(f"'logit_bias' values must be in [-100, 100], got {number!r} for token {token}")
        bias[token] = float(number)
    return bias


def logprobs_problem(sampling: SamplingParams, max_logprobs: int) -> str | None:
    """Why a request asks for more top log-probabilities than the server's bound
    (``--max-logprobs``), or None. Applied where the server's configuration is known: the
    frontend and the engine, before tokenizing."""
    for name in LOGPROBS_FIELDS:
        k = getattr(sampling, name)
        if k is not None and k > max_logprobs:
            return f"'{name}' asks for {k} log-probabilities; this server's bound (--max-logprobs) is {max_logprobs}"
    return None


def signed_seed(seed: int) -> int:
    """``seed`` as the signed 64-bit integer with its low 64 bits: seeds in [0, 2**63) are
    themselves, a negative seed its own value, and [2**63, 2**64) the negative it reads as in
    two's complement. Deterministic, so any 64-bit seed gives a reproducible stream."""
    seed &= SEED_END - 1
    return seed - SEED_END if seed > 2**63 - 1 else seed


def context_problem(
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_token_ids: Sequence[int],
    vocab_size: int | None,
    max_model_len: int,
    *,
    check_ids: bool = True,
    bias_token_ids: Sequence[int] = (),
    min_tokens: int = 0,
) -> str | None:
    """Why a request with this whole context as token ids (a continuation's earlier turns
    included) cannot run on this model, or None: the one statement of these rules. The
    frontend applies it to every tokenized request (:func:`check_tokenized`); the scheduler
    applies it again at its entry, to what in-process callers hand it directly (the engine,
    tests). The prompt
    is not empty, its ids (unless ``check_ids`` is False: ids the tokenizer made are known to
    be in range) and the stop token ids are within ``[0, vocab_size)`` (None: vocabulary
    unknown, only negatives are refused), ``max_tokens`` is at least 1 and the prompt leaves
    room for it within ``max_model_len``; so are the ``logit_bias`` ids (``bias_token_ids``),
    and ``min_tokens`` is at most ``max_tokens`` (checked here, where ``max_tokens`` is final)."""
    if not len(prompt_ids):
        return "prompt tokenizes to zero tokens: the prompt is empty"
    if max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}"
    if min_tokens > max_tokens:
        return f"min_tokens={min_tokens} exceeds max_tokens={max_tokens}"
    limit = vocab_size if vocab_size is not None else math.inf
    checks = (("token id", prompt_ids, check_ids), ("stop token id", stop_token_ids, True), ("logit_bias token id", bias_token_ids, True))
    for what, ids, checked in checks:
        if checked and len(ids) and (min(ids) < 0 or max(ids) >= limit):  # min/max: C speed on long prompts
            bad = next(t for t in ids if not 0 <= t < limit)
            return f"{what} {bad} is outside the vocabulary [0, {vocab_size})"
    return _length_problem(len(prompt_ids), max_tokens, max_model_len)


def _length_problem(n: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why an ``n``-token context with room for ``max_tokens`` does not fit the model, or None."""
    if n >= max_model_len:
        return f"prompt has {n} tokens; the model's limit is {max_model_len} including output"
    if n + max_tokens > max_model_len:
        return (
            f"max_tokens={max_tokens} with a {n}-token prompt exceeds the model length {max_model_len}; "
            f"at most {max_model_len - n} new tokens fit within max_model_len"
        )
    return None


def check_tokenized(
    req: GenerateRequest, prompt_ids: list[int], vocab_size: int, max_model_len: int, *, check_ids: bool = True
) -> None:
    """:func:`context_problem` for a parsed generate request, raised as :class:`ProtocolError`."""
    problem = context_problem(
        prompt_ids,
        req.sampling.max_tokens,
        req.sampling.stop_token_ids,
        vocab_size,
        max_model_len,
        check_ids=check_ids,
        bias_token_ids=list(req.sampling.logit_bias),
        min_tokens=req.sampling.min_tokens,
    )
    if problem is not None:
        too_long = problem == _length_problem(len(prompt_ids), req.sampling.max_tokens, max_model_len)
        code = PROMPT_TOO_LONG if too_long else INVALID_INPUT
        raise ProtocolError(problem, req.request_id, code)
