"""The client wire format's framing and vocabulary: version, message types, error codes.

Maps with named fields (not the positional arrays of internal messages) so a client in any
language can be written from docs/protocol.md alone. Every map has ``type`` and ``v`` (the
protocol version). This module decodes one frame into a map within the decode limits
(:func:`unpack_map`), reads what it can of a frame that does not decode
(:func:`recover_request_id`), and names the error codes a refusal carries
(:class:`ProtocolError`). What the map must hold is :mod:`conveyor.protocol.requests`'s to
check; the replies are built in :mod:`conveyor.protocol.replies`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from conveyor.ipc.messages.lora_updates import LORA_ALREADY_LOADED, LORA_IN_USE, LORA_INVALID, LORA_NOT_FOUND  # noqa: F401 (codes)
from conveyor.protocol.limits import (
    MAX_ARRAY_LEN,
    MAX_CLIENT_MESSAGE_BYTES,
    MAX_EXT_LEN,
    MAX_MAP_LEN,
    MAX_REQUEST_ID_LEN,
    RECOVER_SCAN_BYTES,
    RECOVER_SCAN_KEYS,
)

CLIENT_PROTOCOL_VERSION = 1

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
# waited longer than --max-queue-time, or a load_lora / unload_lora some replica left unanswered: retry later
TIMEOUT = "timeout"
SERVER_ERROR = "server_error"  # the server failed the request: a process died, shutdown, an internal error
LORA_LOADING_DISABLED = (
    "lora_loading_disabled"  # load_lora / unload_lora: the server runs without --enable-lora-loading
)
LORA_UPDATE_PENDING = "lora_update_pending"  # load_lora / unload_lora: another update of the name is unanswered yet
# and the refusals of load_lora / unload_lora the scheduler and worker give (their meaning:
# conveyor.ipc.messages.lora_updates): lora_already_loaded, lora_not_found, invalid_lora, lora_in_use

# Message types, client -> server
GENERATE = "generate"
ABORT = "abort"
STATS = "stats"
PROFILE = "profile"
METRICS = "metrics"
LOAD_LORA = "load_lora"
UNLOAD_LORA = "unload_lora"
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
# Message types, server -> client
DELTA = "delta"
FINAL = "final"
ERROR = "error"
STATS_REPLY = "stats"
PROFILE_REPLY = "profile"
METRICS_REPLY = "metrics"
LORA_REPLY = "lora"
TOKENS_REPLY = "tokens"  # answers tokenize
TEXT_REPLY = "text"  # answers detokenize


# The commands that carry no request id: their answers (and refusals) are told apart by type.
COMMANDS = (STATS, PROFILE, METRICS)


class ProtocolError(ValueError):
    """A client message that cannot be served; ``request_id`` is set when it was readable,
    ``code`` is one of the error codes above. ``command`` is set (one of :data:`COMMANDS`)
    when the message was such a command: its ``error`` map names it, so a client routes the
    refusal to the call waiting for that command's answer instead of leaving it waiting."""

    def __init__(
        self, message: str, request_id: str | None = None, code: str = INVALID_FIELD, command: str | None = None
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code
        self.command = command


class CommandError(ProtocolError):
    """A refused message that names no request (``load_lora``, ``unload_lora``: their id only
    routes the answer): answered with an ``error`` map, never a ``final``."""


class FrameError(ProtocolError):
    """A frame that is not a readable map (:func:`unpack_map`), or a message of the wrong
    frames: it started no request, so it is answered with an ``error`` map, never a
    ``final``; ``request_id`` is what :func:`recover_request_id` could read from it."""


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
