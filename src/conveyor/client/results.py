"""What the server's replies become for a client: :class:`CompletionResult` (a request's
final), :class:`StreamDelta` (a piece of a stream) and their parts, read from the protocol's
maps (docs/protocol.md)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from conveyor.protocol import wire


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV the server reused (prefix cache, continuation)


@dataclass
class Choice:
    """One sequence of a request: its index (0 .. n - 1), text, tokens and why it ended, and
    where asked for its output's log-probability columns (docs/protocol.md)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: dict[str, Any] | None = None


@dataclass
class CompletionResult:
    """A request's outcome. ``choices``: its ``n`` sequences in index order (one for
    ``n`` = 1); ``text``, ``token_ids`` are choice 0's, ``finish_reason`` the request's
    (``abort``/``error`` when it ended as a whole, else choice 0's), ``usage`` counts
    every choice's tokens."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timing: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None
    choices: list[Choice] = field(default_factory=list)
    # Where asked for: the protocol's log-probability columns (docs/protocol.md), as sent.
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None  # where asked (``return_prompt_token_ids``)
    # An embedding request's (Connection.embed) L2-normalized pooled vector.
    embedding: list[float] | None = None
    # The server's weight version the request ran on (weight updates since start; docs/rl.md).
    weight_version: int | None = None

    def __post_init__(self) -> None:
        if not self.choices:  # n = 1: the one choice is the result itself
            self.choices = [Choice(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]


@dataclass
class StreamDelta:
    """One piece of a stream. The last one has ``finish_reason`` set and carries ``result``.
    ``index``: the sequence it belongs to (0 unless the request asked for ``n`` > 1)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    result: CompletionResult | None = None
    index: int = 0
    logprobs: dict[str, Any] | None = None  # of this delta's tokens, where asked for
    prompt_logprobs: dict[str, Any] | None = None  # of prompt tokens not sent before


def completion_result(msg: dict[str, Any]) -> CompletionResult:
    usage = msg.get("usage") or {}
    return CompletionResult(
        request_id=msg["request_id"],
        text=msg.get("text", ""),
        token_ids=list(msg.get("token_ids", [])),
        finish_reason=msg["finish_reason"],
        usage=Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), usage.get("cached_tokens", 0)),
        timing=msg.get("timing") or {},
        error=msg.get("error"),
        choices=[
            Choice(c["index"], c["text"], list(c["token_ids"]), c["finish_reason"], c.get("logprobs"))
            for c in msg.get("choices") or ()
        ],
        logprobs=msg.get("logprobs"),
        prompt_logprobs=msg.get("prompt_logprobs"),
        prompt_token_ids=msg.get("prompt_token_ids"),
        embedding=_floats(msg["embedding"]) if msg.get("embedding") is not None else None,
        weight_version=msg.get("weight_version"),
    )


def _floats(data: bytes) -> list[float]:
    """A final's ``embedding``: little-endian float32 bytes."""
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def to_delta(msg: dict[str, Any]) -> StreamDelta:
    """Turn a server message of a streamed request into a StreamDelta."""
    if msg["type"] == wire.DELTA:
        return StreamDelta(
            msg["request_id"],
            msg.get("text", ""),
            list(msg.get("token_ids", [])),
            logprobs=msg.get("logprobs"),
            prompt_logprobs=msg.get("prompt_logprobs"),
            index=msg.get("index", 0),
        )
    result = completion_result(msg)
    return StreamDelta(result.request_id, "", [], finish_reason=result.finish_reason, result=result)
