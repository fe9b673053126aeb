"""Anthropic Messages answers: the message object (:func:`message_body`), the server-sent
events of a streamed one (:class:`MessageEvents`), and errors in Anthropic's shape
(:func:`error_body`).

A stream is ``message_start``, ``ping``, then per content block ``content_block_start``,
its ``content_block_delta`` events (``text_delta``; ``thinking_delta`` of a ``thinking`` block,
the think block split off by ``--reasoning-parser``, then its ``signature_delta``; a tool call's
arguments as one ``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (``stop_reason``,
``stop_sequence``, the usage) and ``message_stop``; each event is ``event: <type>`` and
``data: <json>``. The prompt's token count is known only at the end (the frontend tokenizes
it), so ``message_start`` carries ``input_tokens`` 0 and ``message_delta`` the real count (the
SDKs take a ``message_delta``'s counts as the totals).

``stop_reason``: ``tool_use`` where the answer made calls, ``max_tokens`` for a length
finish, ``stop_sequence`` where a ``stop_sequences`` entry ended it (read from the kept stop
text by :class:`StopTail`), else ``end_turn``.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from conveyor.client import CompletionResult, StreamDelta
from conveyor.http.errors import ApiError
from conveyor.http.job_runs import checked, generate_all, stream_events
from conveyor.http.link import FrontendLink
from conveyor.http.openai_requests import GenerationJob
from conveyor.http.openai_responses import json_encode
from conveyor.http.output_reading import OutputReader, Reading, output_reader
from conveyor.http.request_ids import request_id
from conveyor.ipc.messages import FinishReason

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); 503 (starting,
# a process died) is Anthropic's "overloaded": try again later.
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPE.get(error.status, "api_error"), "message": error.message}}


def message_id(request_id: str) -> str:
    return "msg_" + request_id


class StopTail:
    """Which ``stop_sequences`` entry ended an answer. The frontend keeps the stop text in the
    output (``include_stop_str_in_output``), so the last ``len(longest stop)`` characters are
    held back until the end: an answer that stopped and ends with an entry ended by it (its
    text is dropped, as Anthropic leaves it out); else the held text is released."""

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = stops or []
        self.keep = max(map(len, self.stops), default=0)
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.keep:
            return text
        self.held += text
        if len(self.held) <= self.keep:
            return ""
        out, self.held = self.held[: -self.keep], self.held[-self.keep :]
        return out

    def finish(self, finish_reason: str) -> tuple[str, str | None]:
        """The held text to release, and the stop sequence that ended the answer (None: none)."""
        held, self.held = self.held, ""
        if finish_reason == FinishReason.STOP:
            for stop in self.stops:
                if held.endswith(stop):
                    return held[: len(held) - len(stop)], stop
        return held, None


def stop_reason(finish_reason: str, called: bool, stop: str | None) -> str:
    if called:
        return "tool_use"
    if finish_reason == FinishReason.LENGTH:
        return "max_tokens"
    return "stop_sequence" if stop is not None else "end_turn"


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (arguments as JSON text) as a ``tool_use`` block."""
    fn = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": fn["name"],
        "input": json.loads(fn["arguments"]),
    }


def usage(result: CompletionResult) -> dict[str, int]:
    return {"input_tokens": result.usage.prompt_tokens, "output_tokens": result.usage.completion_tokens}


def message_body(
    rid: str, model: str, result: CompletionResult, stops: list[str] | None, reader: OutputReader | None
) -> dict[str, Any]:
    """The unstreamed message of ``result`` (its stop text dropped, its reasoning and calls
    read by ``reader``)."""
    tail = StopTail(stops)
    text = tail.feed(result.text)
    rest, stop = tail.finish(result.finish_reason)
    text += rest
    reasoning, text, calls = reader.whole(text) if reader is not None else (None, text, [])
    content: list[dict[str, Any]] = [_thinking(reasoning)] if reasoning is not None else []
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [_tool_use(c) for c in calls]
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(result.finish_reason, bool(calls), stop),
        "stop_sequence": stop,
        "usage": usage(result),
    }


def _thinking(text: str) -> dict[str, Any]:
    """A ``thinking`` block (its ``signature`` empty: nothing here signs reasoning)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_encode({"type": kind, **obj}) + b"\n\n"


class MessageEvents:
    """The events of one streamed message (a :class:`conveyor.http.job_runs.StreamEncoder`):
    text released by :class:`StopTail` and the output reader, a thinking or text block opened
    on its first text and closed when another kind of block follows."""

    def __init__(self, rid: str, model: str, stops: list[str] | None, reader: OutputReader | None) -> None:
        self.out = bytearray()
        self.rid, self.model = rid, model
        self.tail = StopTail(stops)
        self.feed = reader.stream() if reader else None
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the kind of the block being streamed (text, thinking)
        self.called = False

    def start(self) -> None:
        message = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        self.out += event("message_start", {"message": message}) + event("ping", {})

    def __call__(self, index: int, delta: StreamDelta) -> int:
        if delta.text:
            self._pieces(self.tail.feed(delta.text))
        if delta.result is None:
            return 0
        result = checked(delta.result)
        rest, stop = self.tail.finish(result.finish_reason)
        self._pieces(rest, end=True)
        self._close()
        reason = stop_reason(result.finish_reason, self.called, stop)
        self.out += event(
            "message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop}, "usage": usage(result)}
        )
        return 1

    def _pieces(self, text: str, end: bool = False) -> None:
        if self.feed is None:
            readings = [Reading(content=text)]
        else:  # the reader's last release: ``text`` (the held stop tail) fed, then its end
            readings = ([self.feed(text)] if text else []) + ([self.feed(None)] if end else [])
        for reading in readings:
            if reading.reasoning or reading.opened:  # an empty think block is an empty thinking block, as whole
                self._block("thinking", reading.reasoning)
            if reading.content:
                self._block("text", reading.content)
            for call in reading.calls:
                self._call(call)

    def _block(self, kind: str, text: str) -> None:
        if self.open != kind:
            self._close()
            start = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
            self.out += event("content_block_start", {"index": self.blocks, "content_block": start})
            self.open = kind
        if not text:
            return
        delta = (
            {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        )
        self.out += event("content_block_delta", {"index": self.blocks, "delta": delta})

    def _call(self, call: dict[str, Any]) -> None:
        self._close()
        block = _tool_use(call)
        arguments = json_encode(block["input"]).decode()
        self.out += event("content_block_start", {"index": self.blocks, "content_block": {**block, "input": {}}})
        self.out += event(
            "content_block_delta",
            {"index": self.blocks, "delta": {"type": "input_json_delta", "partial_json": arguments}},
        )
        self.out += event("content_block_stop", {"index": self.blocks})
        self.blocks += 1
        self.called = True

    def _close(self) -> None:
        if self.open == "thinking":  # Anthropic's thinking block ends with its signature (empty here)
            self.out += event(
                "content_block_delta", {"index": self.blocks, "delta": {"type": "signature_delta", "signature": ""}}
            )
        if self.open is not None:
            self.out += event("content_block_stop", {"index": self.blocks})
            self.blocks += 1
            self.open = None

    def fail(self, error: ApiError) -> None:
        self._close()
        self.out += event("error", {"error": error_body(error)["error"]})

    def end(self) -> None:
        self.out += event("message_stop", {})


async def respond_message(
    request: web.Request,
    link: FrontendLink,
    job: GenerationJob,
    model: str,
    tool_parser: str | None,
    headers: dict[str, str],
    reasoning_parser: str | None = None,
) -> web.StreamResponse:
    """The answer to a ``/v1/messages`` job, through the one lifecycle of :mod:`conveyor.http.job_runs`."""
    await link.require_started()
    rid = message_id(request_id(request))
    stops = job.options.get("stop")
    reader = output_reader(job, tool_parser, reasoning_parser)
    if job.stream:
        return await stream_events(request, link, job, MessageEvents(rid, model, stops, reader), headers)
    result = (await generate_all(link, job))[0]
    return web.Response(
        body=json_encode(message_body(rid, model, result, stops, reader)),
        content_type="application/json",
        headers=headers,
    )
