"""OpenAI Responses answers: the response object (:func:`response_body`) and the server-sent
events of a streamed one (:class:`ResponseEvents`), through the one request lifecycle of
:mod:`conveyor.http.job_runs` (:func:`respond_response`).

The answer's text is read by :class:`conveyor.http.output_reading.OutputReader` into output
items, in order: a ``reasoning`` item (the think block, with ``--reasoning-parser``), a
``message`` item (``output_text``), ``function_call`` items. A stream is
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``,
for text ``response.content_part.added``, the deltas (``response.output_text.delta`` /
``response.reasoning_text.delta``), ``response.output_text.done`` / ``.reasoning_text.done``,
``response.content_part.done``; for a call ``response.function_call_arguments.delta`` (all
its arguments in one) and ``.done``; then ``response.output_item.done``; last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it). Every
event is ``event: <type>`` + ``data: <json>`` with its ``sequence_number``. A failure after
the stream began is an ``error`` event, then ``response.failed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from conveyor.client import CompletionResult, StreamDelta
from conveyor.http.errors import ApiError
from conveyor.http.job_runs import checked, generate_all, stream_events
from conveyor.http.link import FrontendLink
from conveyor.http.openai_responses import json_encode
from conveyor.http.output_reading import OutputReader, Reading, counting_reader
from conveyor.http.request_ids import request_id
from conveyor.http.responses_requests import ResponsesRequest
from conveyor.http.tokens import Tokens
from conveyor.ipc.messages import FinishReason


def _usage(result: CompletionResult | None, reader: OutputReader | None) -> dict[str, Any] | None:
    if result is None:
        return None
    u = result.usage
    reasoning = reader.reasoning_tokens([result]) if reader is not None else 0
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


class _Response:
    """One response's fixed parts (id, time, model, what it echoes of the request) and its items."""

    def __init__(self, rid: str, model: str, echo: dict[str, Any], reader: OutputReader | None = None) -> None:
        self.rid, self.model, self.echo, self.reader = rid, model, echo, reader
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []

    def item_id(self, prefix: str) -> str:
        return f"{prefix}_{len(self.items)}_{self.rid.removeprefix('resp_')}"

    def body(self, status: str, result: CompletionResult | None, error: ApiError | None = None) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": list(self.items),
            "usage": _usage(result, self.reader),
            "error": None if error is None else {"code": error.code or error.type, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "store": False,
            "previous_response_id": None,
            "truncation": "disabled",
            **self.echo,
        }


def _status(result: CompletionResult) -> str:
    return "incomplete" if result.finish_reason == FinishReason.LENGTH else "completed"


def _text_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _text_item(response: _Response, kind: str, text: str, status: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {
            "id": response.item_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [_text_part(kind, text)],
            "status": status,
        }
    return {
        "id": response.item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(kind, text)],
    }


def _call_item(response: _Response, call: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": response.item_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def response_body(response: _Response, result: CompletionResult, reader: OutputReader | None) -> dict[str, Any]:
    """The unstreamed response of ``result``: its items as :class:`OutputReader` reads them."""
    reasoning, content, calls = reader.whole(result.text) if reader is not None else (None, result.text, [])
    status = _status(result)
    if reasoning is not None:
        response.items.append(_text_item(response, "reasoning", reasoning, "completed" if content or calls else status))
    if content or not calls:
        response.items.append(_text_item(response, "message", content, status))
    for call in calls:
        response.items.append(_call_item(response, call, call["function"]["arguments"], "completed"))
    return response.body(status, result)


class ResponseEvents:
    """The events of one streamed response (a :class:`conveyor.http.job_runs.StreamEncoder`):
    a text item opened on its first text and closed when another kind of output follows."""

    def __init__(self, response: _Response, reader: OutputReader | None) -> None:
        self.out = bytearray()
        self.response = response
        self.sequence = 0
        self.feed: Callable[[str | None], Reading] = (
            reader.stream() if reader is not None else (lambda text: Reading(content=text or ""))
        )
        self.open: dict[str, Any] | None = None  # the text item being streamed
        self.text = ""  # its text so far
        self.final: dict[str, Any] | None = None

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        data = json_encode({"type": kind, **obj, "sequence_number": self.sequence})
        self.out += b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
        self.sequence += 1

    def start(self) -> None:
        body = self.response.body("in_progress", None)
        self._event("response.created", {"response": body})
        self._event("response.in_progress", {"response": body})

    def __call__(self, index: int, delta: StreamDelta) -> int:
        if delta.text:
            self._reading(self.feed(delta.text))
        if delta.result is None:
            return 0
        result = checked(delta.result)
        self._reading(self.feed(None))
        status = _status(result)
        self._close(status)
        self.final = self.response.body(status, result)
        return 1

    def _reading(self, reading: Reading) -> None:
        if reading.reasoning or reading.opened:  # an empty think block is an empty reasoning item, as whole
            self._text("reasoning", reading.reasoning)
        if reading.content:
            self._text("message", reading.content)
        for call in reading.calls:
            self._close("completed")
            self._call(call)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.response.items)}  # type: ignore[index]

    def _text(self, kind: str, text: str) -> None:
        if self.open is not None and self.open["type"] != kind:
            self._close("completed")
        if self.open is None:
            self.open, self.text = _text_item(self.response, kind, "", "in_progress"), ""
            self.open["content"] = []
            self._event("response.output_item.added", {"output_index": len(self.response.items), "item": self.open})
            self._event(
                "response.content_part.added", {**self._where(), "content_index": 0, "part": _text_part(kind, "")}
            )
        self.text += text
        if not text:
            return
        if kind == "reasoning":
            self._event("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": text})
        else:
            self._event(
                "response.output_text.delta", {**self._where(), "content_index": 0, "delta": text, "logprobs": []}
            )

    def _close(self, status: str) -> None:
        if self.open is None:
            return
        kind, where = self.open["type"], self._where()
        if kind == "reasoning":
            self._event("response.reasoning_text.done", {**where, "content_index": 0, "text": self.text})
        else:
            self._event("response.output_text.done", {**where, "content_index": 0, "text": self.text, "logprobs": []})
        part = _text_part(kind, self.text)
        self._event("response.content_part.done", {**where, "content_index": 0, "part": part})
        item = {**self.open, "status": status, "content": [part]}
        self._event("response.output_item.done", {"output_index": where["output_index"], "item": item})
        self.response.items.append(item)
        self.open = None

    def _call(self, call: dict[str, Any]) -> None:
        arguments = call["function"]["arguments"]
        item = _call_item(self.response, call, "", "in_progress")
        where = {"item_id": item["id"], "output_index": len(self.response.items)}
        self._event("response.output_item.added", {"output_index": where["output_index"], "item": item})
        self._event("response.function_call_arguments.delta", {**where, "delta": arguments})
        self._event("response.function_call_arguments.done", {**where, "name": item["name"], "arguments": arguments})
        done = {**item, "arguments": arguments, "status": "completed"}
        self._event("response.output_item.done", {"output_index": where["output_index"], "item": done})
        self.response.items.append(done)

    def fail(self, error: ApiError) -> None:
        self._close("incomplete")
        self._event("error", {"code": error.code or error.type, "message": error.message, "param": error.param})
        self._event("response.failed", {"response": self.response.body("failed", None, error)})

    def end(self) -> None:
        final = self.final or self.response.body("completed", None)
        self._event(
            "response.incomplete" if final["status"] == "incomplete" else "response.completed", {"response": final}
        )


async def respond_response(
    request: web.Request,
    link: FrontendLink,
    parsed: ResponsesRequest,
    model: str,
    tokens: Tokens,
    tool_parser: str | None,
    reasoning_parser: str | None,
    headers: dict[str, str],
) -> web.StreamResponse:
    """The answer to a ``/v1/responses`` job, through the one lifecycle of :mod:`conveyor.http.job_runs`."""
    await link.require_started()
    job = parsed.job
    reader = await counting_reader(job, tool_parser, reasoning_parser, tokens)
    response = _Response("resp_" + request_id(request), model, parsed.echo, reader)
    if job.stream:
        return await stream_events(request, link, job, ResponseEvents(response, reader), headers)
    result = (await generate_all(link, job))[0]
    return web.Response(
        body=json_encode(response_body(response, result, reader)), content_type="application/json", headers=headers
    )
