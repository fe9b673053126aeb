"""OpenAI response objects and server-sent-event chunks, built from client-protocol results.

Unstreamed answers are plain dicts (:func:`completion_body`). A stream is a run of
``data: <json>\\n\\n`` events ending in ``data: [DONE]``: per choice, content chunks, then
one chunk with its ``finish_reason``; with ``stream_options.include_usage`` every chunk
carries ``"usage": null`` and one last chunk with no choices carries the usage.
:class:`ChunkEncoder` builds the content chunk, the one sent per token batch of every
stream, from bytes fixed per response and choice plus the JSON-encoded text, so a token
costs one string encode; :func:`chunk_object` is the same chunk as a dict (tests hold the
two equal). Chunks that carry more than the text (``return_token_ids``'s ids, the usage
so far of ``continuous_usage_stats``) are built as dicts (:meth:`ChunkEncoder.chunk`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.client import CompletionResult
from conveyor.http.errors import ApiError
from conveyor.http.openai_requests import CHAT, COMPLETION

DONE = b"data: [DONE]\n\n"
_OBJECT = {COMPLETION: "text_completion", CHAT: "chat.completion"}
_CHUNK_OBJECT = {COMPLETION: "text_completion", CHAT: "chat.completion.chunk"}
_ID_PREFIX = {COMPLETION: "cmpl-", CHAT: "chatcmpl-"}

json_encode = msgspec.json.Encoder().encode


def response_id(kind: str, request_id: str) -> str:
    return _ID_PREFIX[kind] + request_id


def usage(results: list[CompletionResult], reasoning_tokens: int | None = None) -> dict[str, Any]:
    """The OpenAI ``usage`` of one response: every input's prompt once, every choice's
    tokens added up (a result's ``completion_tokens`` counts all its ``n`` choices);
    ``reasoning_tokens`` (a server with a reasoning parser): how many of those were the think blocks'."""
    prompt = sum(r.usage.prompt_tokens for r in results)
    completion = sum(r.usage.completion_tokens for r in results)
    cached = sum(r.usage.cached_tokens for r in results)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage one streamed chunk carries under ``continuous_usage_stats``: its choice's."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    kind: str,
    rid: str,
    created: int,
    model: str,
    results: list[CompletionResult],
    *,
    echoes: list[str] | None = None,
    prompt_ids: list[list[int]] | None = None,
    extras: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The unstreamed answer: one choice per sequence of each result (``n`` per input), in
    order: input ``i``'s sequence ``j`` is choice ``i * n + j``. ``echoes`` start each
    input's choices' texts (``echo``); with ``prompt_ids`` (``return_token_ids``) each choice
    carries its ``token_ids`` and the prompt's (a completion choice its own
    ``prompt_token_ids``, a chat answer one at the top, as vLLM). ``extras``: per choice, its
    ``logprobs`` (replacing the null) and its input's ``prompt_logprobs`` (a chat answer's
    once, at the top, as vLLM)."""
    flat = [(i, seq) for i, r in enumerate(results) for seq in r.choices]
    texts = [seq.text if echoes is None else echoes[i] + seq.text for i, seq in flat]
    if kind == COMPLETION:
        choices = [
            {"index": k, "text": texts[k], "logprobs": None, "finish_reason": seq.finish_reason}
            for k, (_, seq) in enumerate(flat)
        ]
    else:
        choices = [
            {
                "index": k,
                "message": {"role": "assistant", "content": texts[k]},
                "logprobs": None,
                "finish_reason": seq.finish_reason,
            }
            for k, (_, seq) in enumerate(flat)
        ]
    body = {
        "id": rid,
        "object": _OBJECT[kind],
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(results),
    }
    if extras is not None:
        for choice, extra in zip(choices, extras):
            choice.update(extra)
        if kind == CHAT and "prompt_logprobs" in extras[0]:
            body["prompt_logprobs"] = [choice.pop("prompt_logprobs") for choice in choices][0]
    if prompt_ids is not None:
        for choice, (i, seq) in zip(choices, flat):
            choice["token_ids"] = seq.token_ids
            if kind == COMPLETION:
                choice["prompt_token_ids"] = prompt_ids[i]
        if kind == CHAT:
            body["prompt_token_ids"] = prompt_ids[0]
    return body


def chunk_object(
    kind: str,
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str | None,
    finish_reason: str | None,
    include_usage: bool,
    *,
    extra: dict[str, Any] | None = None,
    chunk_usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice ``index`` as a dict: ``text`` (None: no content; for
    chat an empty ``delta``) and/or the choice's ``finish_reason``; ``extra``: more fields of
    the choice (token ids); ``chunk_usage``: the usage so far (else null, with ``include_usage``)."""
    if kind == COMPLETION:
        choice: dict[str, Any] = {"index": index, "text": text or ""}
    else:
        choice = {"index": index, "delta": {} if text is None else {"content": text}}
    choice.update(logprobs=None, finish_reason=finish_reason)
    if extra:
        choice.update(extra)
    chunk = {"id": rid, "object": _CHUNK_OBJECT[kind], "created": created, "model": model, "choices": [choice]}
    if include_usage:
        chunk["usage"] = chunk_usage
    return chunk


def event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json_encode(obj) + b"\n\n"


class ChunkEncoder:
    """The SSE events of one streamed response (its id, time and model fixed)."""

    def __init__(self, kind: str, rid: str, created: int, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.rid = rid
        self.created = created
        self.model = model
        self.include_usage = include_usage
        head = json_encode({"id": rid, "object": _CHUNK_OBJECT[kind], "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'
        text_key = b',"text":' if kind == COMPLETION else b',"delta":{"content":'
        self._text_key = text_key
        self._tail = (
            (b"" if kind == COMPLETION else b"}")
            + b',"logprobs":null,"finish_reason":null}]'
            + (b',"usage":null}\n\n' if include_usage else b"}\n\n")
        )
        self._prefixes: dict[int, bytes] = {}

    def text(self, index: int, text: str) -> bytes:
        """The content chunk of choice ``index`` (the per-token path)."""
        prefix = self._prefixes.get(index)
        if prefix is None:
            prefix = self._prefixes[index] = self._head + str(index).encode() + self._text_key
        return prefix + json_encode(text) + self._tail

    def role(self, index: int) -> bytes:
        """A chat stream's first chunk of a choice: the assistant role, empty content."""
        chunk = chunk_object(self.kind, self.rid, self.created, self.model, index, "", None, self.include_usage)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return event(chunk)

    def finish(
        self,
        index: int,
        finish_reason: str,
        extra: dict[str, Any] | None = None,
        chunk_usage: dict[str, int] | None = None,
    ) -> bytes:
        return self.chunk(index, None, finish_reason, extra, chunk_usage)

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        extra: dict[str, Any] | None = None,
        chunk_usage: dict[str, int] | None = None,
    ) -> bytes:
        """A chunk with more than text (:func:`chunk_object`'s ``extra`` and ``chunk_usage``)."""
        obj = chunk_object(
            self.kind, self.rid, self.created, self.model, index, text, finish_reason, self.include_usage,
            extra=extra, chunk_usage=chunk_usage,
        )  # fmt: skip
        return event(obj)

    def usage(self, results: list[CompletionResult], reasoning_tokens: int | None = None) -> bytes:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return event(
            {
                "id": self.rid,
                "object": _CHUNK_OBJECT[self.kind],
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(results, reasoning_tokens),
            }
        )

    @staticmethod
    def error(error: ApiError) -> bytes:
        """A failure after the stream began (its status is sent already): the error object
        as an event, which the openai client raises as an ``APIError``."""
        return event(error.body())
