"""The server's side of the client protocol: the maps the frontend sends (docs/protocol.md).

:mod:`conveyor.protocol.requests` parses and validates what clients send; this module builds
what they get back, so each reply's fields are named in one place. Every map carries ``type``
and ``v`` (:data:`CLIENT_PROTOCOL_VERSION`).

A ``delta`` is sent once per token of every stream, so it is not built as a map: its packed
bytes are :func:`delta_head` (fixed per request, computed once) + the packed text +
:data:`DELTA_IDS_KEY` + the packed token ids, which are exactly the bytes msgpack gives the
map ``{type, v, request_id, text, token_ids}`` in that order (a property test holds the two
together).
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from conveyor.ipc.messages import FinishReason, SchedulerStats, speculation_rates
from conveyor.protocol.wire import (
    CLIENT_PROTOCOL_VERSION,
    DELTA,
    ERROR,
    FINAL,
    INVALID_FIELD,
    LORA_REPLY,
    METRICS_REPLY,
    OVERLOADED,
    PROFILE_REPLY,
    PROMPT_TOO_LONG,
    SERVER_ERROR,
    STATS_REPLY,
    TIMEOUT,
)

# A delta's bytes before its request id: a map of 5 entries, then type and v with their values.
_DELTA_PREFIX = b"\x85" + b"".join(
    msgpack.packb(x) for x in ("type", DELTA, "v", CLIENT_PROTOCOL_VERSION, "request_id")
)
# The same with 6 entries: a delta of one sequence of an ``n`` > 1 request also carries its ``index``.
_INDEXED_DELTA_PREFIX = b"\x86" + _DELTA_PREFIX[1:]
_DELTA_TEXT_KEY = msgpack.packb("text")
DELTA_IDS_KEY = msgpack.packb("token_ids")
# SchedulerStats fields that are not stats fields of the reply (the query's id, the iteration
# log in its compact form: rows under ``iteration_fields``).
_STATS_INTERNAL = frozenset({"query_id", "iteration_fields", "recent_iterations"})


def delta_head(request_id: str, index: int | None = None) -> bytes:
    """The packed bytes of a delta for ``request_id`` up to its text's value; with ``index``
    (a sequence of an ``n`` > 1 request) the map ``{type, v, request_id, index, text, token_ids}``."""
    rid = msgpack.packb(request_id, use_bin_type=True)
    if index is None:
        return _DELTA_PREFIX + rid + _DELTA_TEXT_KEY
    return _INDEXED_DELTA_PREFIX + rid + msgpack.packb("index") + msgpack.packb(index) + _DELTA_TEXT_KEY


def final_reply(
    request_id: str,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    error: str | None,
    *,
    prompt_tokens: int,
    cached_tokens: int,
    timing: dict[str, float | None],
    code: str | None = None,
    choices: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A request's one ``final``: its whole text and tokens, why it ended, usage and timing;
    with ``finish_reason`` ``error``, ``error`` says what went wrong and ``code`` which kind of
    problem it is (an error code of :mod:`conveyor.protocol.wire`; None otherwise).

    ``choices`` (an ``n`` > 1 request): one ``{index, text, token_ids, finish_reason}`` per
    sequence, in index order; ``text``/``token_ids`` are then choice 0's and
    ``usage.completion_tokens`` counts every choice's tokens."""
    reply = {
        "type": FINAL,
        "v": CLIENT_PROTOCOL_VERSION,
        "request_id": request_id,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "error": error,
        "code": code,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(token_ids) if choices is None else sum(len(c["token_ids"]) for c in choices),
            "cached_tokens": cached_tokens,
        },
        "timing": timing,
    }
    if choices is not None:
        reply["choices"] = choices
    return reply


def error_reply(
    request_id: str | None, message: str, code: str = INVALID_FIELD, *, command: str | None = None
) -> dict[str, Any]:
    """The answer to a message that cannot be served: the ``final`` of an ``error`` request
    when the message named a request (and no other final is coming under its id), else an
    ``error`` map (:func:`error_map`, naming ``command`` when the message was one)."""
    if request_id is None:
        return error_map(None, message, code, command=command)
    timing = {"queue_time": None, "ttft": None, "total": 0.0}
    return final_reply(
        request_id, "", [], FinishReason.ERROR, message, prompt_tokens=0, cached_tokens=0, timing=timing, code=code
    )


def error_map(request_id: str | None, message: str, code: str, *, command: str | None = None) -> dict[str, Any]:
    """An ``error`` map: the answer to a message that started no request and ends none (an
    undecodable frame, wrong frames, a duplicate in-flight id, a refused or failed command).
    ``request_id`` is the id the message carried when it could be read, else None; a client
    tells it from a request's ``final`` by its ``type``. ``command`` (``stats``, ``profile``,
    ``metrics``: they carry no id) names the command it answers, and only then is present."""
    reply = {"type": ERROR, "v": CLIENT_PROTOCOL_VERSION, "request_id": request_id, "code": code, "message": message}
    if command is not None:
        reply["command"] = command
    return reply


def scheduler_error_code(error: str | None) -> str:
    """The code of an error a request got from the scheduler or the server (its text is
    the scheduler's): ``overloaded:`` and ``timeout:`` say retry later, a request too large
    for the KV cache is :data:`PROMPT_TOO_LONG`, anything else is the server's failure."""
    text = error or ""
    if text.startswith("overloaded:"):
        return OVERLOADED
    if text.startswith("timeout:"):
        return TIMEOUT
    if text.startswith("prompt + max_tokens = "):  # scheduler/admission.py: never fits the KV pool
        return PROMPT_TOO_LONG
    return SERVER_ERROR


def stats_reply(stats: SchedulerStats, in_flight: int, *, iterations: bool) -> dict[str, Any]:
    """The ``stats`` map: the scheduler's block pool, queues and counters (with the
    speculative-decoding ratios derived from them), the frontend's requests in flight, and
    (``iterations``) the recent iterations as one map each."""
    reply = {k: v for k, v in msgspec.structs.asdict(stats).items() if k not in _STATS_INTERNAL}
    reply.update(speculation_rates(reply))
    if iterations:
        reply["iterations"] = [dict(zip(stats.iteration_fields, row)) for row in stats.recent_iterations]
    reply.update(type=STATS_REPLY, v=CLIENT_PROTOCOL_VERSION, in_flight=in_flight)
    return reply


def profile_reply(clock: str, window_s: float, processes: list[dict[str, Any]], error: str | None) -> dict[str, Any]:
    """The ``profile`` map: each process's profile (``profiling.profile_to_map``) over the window."""
    return {
        "type": PROFILE_REPLY,
        "v": CLIENT_PROTOCOL_VERSION,
        "clock": clock,
        "window_s": window_s,
        "processes": processes,
        "error": error,
    }


def lora_reply(request_id: str, name: str, loaded: bool) -> dict[str, Any]:
    """The ``lora`` map answering a ``load_lora`` (``loaded`` true) or an ``unload_lora``
    (false) that succeeded on every replica; a refusal is an ``error`` map under the same id."""
    return {
        "type": LORA_REPLY,
        "v": CLIENT_PROTOCOL_VERSION,
        "request_id": request_id,
        "lora_name": name,
        "loaded": loaded,
    }


def metrics_reply(counters: dict[str, Any], histograms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``metrics`` map: the frontend's request-level counters and latency histograms
    (:meth:`conveyor.frontend.request_metrics.FrontendMetrics.snapshot`). ``counters``: name -> count,
    or reason -> count for ``request_success``; ``histograms``: name -> ``{buckets: [upper
    bounds, s], counts: [per bucket, not cumulative; one more than buckets, the last above
    every bound], sum, count}``."""
    return {"type": METRICS_REPLY, "v": CLIENT_PROTOCOL_VERSION, "counters": counters, "histograms": histograms}
