"""``/v1/completions`` and ``/v1/chat/completions``: a :class:`GenerationJob` run through the
frontend link, answered whole or as server-sent events.

Each input of the job is one client-protocol request. Unstreamed, the answer waits for every
final; streamed, the response's status is decided before anything is sent: the stream waits
until every input has its first reply (a token, or a refusal), so a bad field, an unknown
model or a full queue is a 400 / 404 / 429 with the OpenAI error object, not a 200 that
turns into an error event. A failure after that (a process died) is sent as an error event
followed by ``[DONE]``.

Fields beyond the text (:class:`GenerationJob`): ``echo`` starts each choice's text with its
prompt (the string sent, or a token-id prompt decoded), ``return_token_ids`` adds the token
ids, ``continuous_usage_stats`` the usage so far to every chunk, ``logprobs`` the
log-probabilities in OpenAI's shapes (:mod:`conveyor.http.openai_logprobs`; with ``echo``, the
prompt's first, and each streamed chunk's for its own tokens) and ``prompt_logprobs``
vLLM's per-prompt-token list; the prompt's ids these need
come from the HTTP process's tokenizer (:mod:`conveyor.http.tokens`), asked only when a
request needs them. The body's ignored fields are named in the ``x-conveyor-ignored-fields``
header and a log line.

Disconnects: the app runs with aiohttp's handler cancellation, so a client that goes away
cancels the handler; the cancellation reaches the AsyncClient call (or, for several
inputs, every task the handler started, which are always cancelled and awaited on the way
out), and the AsyncClient aborts its request at the server, which frees its KV blocks
within an iteration. Streams are closed deterministically (``aclosing``), never left to
the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from conveyor.client import CompletionResult, StreamDelta
from conveyor.http.connections import BODY_TIMEOUT, BODY_TIMEOUT_S, COUNTS
from conveyor.http.errors import ApiError, from_final_error
from conveyor.http.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from conveyor.http.link import FrontendLink, api_error
from conveyor.http.openai_requests import CHAT, COMPLETION, GenerationJob
from conveyor.http.openai_responses import DONE, ChunkEncoder, completion_body, json_encode, response_id, usage_so_far
from conveyor.http.tokens import Tokens
from conveyor.ipc.messages import FinishReason
from conveyor.structured.tool_calls import ToolCallParser, parse_tool_calls
from conveyor.structured.tool_choice import constrained_tool_calls

log = logging.getLogger("conveyor.http")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
IGNORED_FIELDS_HEADER = "x-conveyor-ignored-fields"
# The request's key of a stream response that is prepared (its 200 sent): the error middleware
# answers a failure after that with the stream itself, never a second response.
STARTED_RESPONSE = "conveyor.started_response"


class _Prompts:
    """What a job needs of its prompts: their ids (``return_token_ids``, continuous usage)
    and the texts ``echo`` puts in front (None where not asked)."""

    def __init__(self, ids: list[list[int]] | None, echoes: list[str] | None, first_tokens: list[str] | None = None) -> None:
        self.ids = ids
        self.echoes = echoes
        self.first_tokens = first_tokens  # echo with logprobs: each prompt's first token's text (it has no value)


async def _prompts(job: GenerationJob, tokens: Tokens) -> _Prompts:
    ids = None
    echo_logprobs = job.echo and job.kind == COMPLETION and job.logprobs is not None
    if job.return_token_ids or job.continuous_usage or job.prompt_logprobs or echo_logprobs:
        ids = [await tokens.prompt_ids(inp, job.options) for inp in job.inputs]
    echoes = None
    if job.echo and job.kind == COMPLETION:
        echoes = [inp["prompt"] if "prompt" in inp else await tokens.decode(inp["token_ids"]) for inp in job.inputs]
    first_tokens = None
    if echo_logprobs:
        tokenizer = await tokens.tokenizer()
        first_tokens = [tokenizer.decode_one(p[0], False) for p in ids]  # type: ignore[union-attr]
    return _Prompts(ids, echoes, first_tokens)


def _logprob_fields(
    job: GenerationJob, prompts: _Prompts, index: int, rows: dict | None, prompt_rows: dict | None, offset: int, first: bool
) -> dict[str, Any]:
    """The log-probability fields of choice ``index`` for output ``rows`` and ``prompt_rows``
    (a whole answer's, or one chunk's: ``first`` for its first, which carries the echoed
    prompt's); ``offset``: the text offset of the first token listed."""
    fields: dict[str, Any] = {}
    if job.logprobs is not None:
        if job.kind == CHAT:
            fields["logprobs"] = chat_logprobs(rows) if rows else None
        elif first and prompts.first_tokens is not None:
            fields["logprobs"] = completion_logprobs(rows, offset, prompt_rows or {}, prompts.first_tokens[index])
        elif rows:
            fields["logprobs"] = completion_logprobs(rows, offset)
    if job.prompt_logprobs and prompt_rows:
        fields["prompt_logprobs"] = prompt_logprobs(prompt_rows, prompts.ids[index])  # type: ignore[index]
    return fields


async def respond(
    request: web.Request, link: FrontendLink, job: GenerationJob, model: str, tokens: Tokens, tool_parser: str | None = None
) -> web.StreamResponse:
    """The HTTP answer to ``job``; :class:`ApiError` for a failure known before it starts.
    ``tool_parser``: the server's ``--tool-call-parser`` (None: a chat's tools are rendered,
    its output is not parsed for calls unless ``tool_choice`` forced them)."""
    await link.require_started()
    rid = response_id(job.kind, uuid.uuid4().hex)
    created = int(time.time())
    headers = {}
    if job.ignored:
        headers[IGNORED_FIELDS_HEADER] = ",".join(job.ignored)
        log.info("%s: ignored request field(s) with no effect here: %s", rid, ", ".join(job.ignored))
    prompts = await _prompts(job, tokens)
    if job.stream:
        enc = ChunkEncoder(job.kind, rid, created, model, job.include_usage)
        return await _stream(request, link, job, enc, prompts, headers, _tool_reader(job, tool_parser))
    results = await _generate_all(link, job)
    prompt_ids = prompts.ids if job.return_token_ids else None
    extras = None
    if job.logprobs is not None or job.prompt_logprobs:
        extras = [
            _logprob_fields(job, prompts, i, c.logprobs, r.prompt_logprobs, 0, True) for i, r in enumerate(results) for c in r.choices
        ]
    body = completion_body(job.kind, rid, created, model, results, echoes=prompts.echoes, prompt_ids=prompt_ids, extras=extras)
    reader = _tool_reader(job, tool_parser)
    if reader is not None:  # each choice read on its own (n > 1: each sequence wrote its own calls)
        for choice, seq in zip(body["choices"], [seq for r in results for seq in r.choices]):
            content, calls = reader.whole(seq.text)
            if calls:
                choice["message"] = {"role": "assistant", "content": content or None,
                                     "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
                choice["finish_reason"] = _tool_finish(seq.finish_reason)
    return web.Response(body=json_encode(body), content_type="application/json", headers=headers)


def _tool_finish(reason: str) -> str:
    """OpenAI's ``tool_calls`` where the output ended by itself with calls; else as it ended."""
    return "tool_calls" if reason == FinishReason.STOP else reason


class _ToolReader:
    """How a chat job's output is read for tool calls: the constrained JSON of a forcing
    ``tool_choice`` (read whole at the end), or the server's parser format (streamed: content
    released as soon as it cannot start a call, each call as one delta)."""

    def __init__(self, forced: Any, format: str | None) -> None:
        self.forced, self.format = forced, format

    def whole(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.forced is not None:
            try:
                return "", constrained_tool_calls(text, self.forced)
            except (ValueError, KeyError, TypeError):  # cut short (length): not a whole call
                return text, []
        parsed = parse_tool_calls(text, self.format)  # type: ignore[arg-type]
        return parsed.content, parsed.tool_calls

    def stream(self) -> Callable[[str | None], tuple[str, list[dict[str, Any]]]]:
        """A feeder: ``feed(text)`` per delta, ``feed(None)`` at the end."""
        if self.forced is not None:
            held: list[str] = []

            def feed_forced(text: str | None) -> tuple[str, list[dict[str, Any]]]:
                if text is not None:
                    held.append(text)
                    return "", []
                return self.whole("".join(held))

            return feed_forced
        parser = ToolCallParser(self.format)  # type: ignore[arg-type]

        def feed(text: str | None) -> tuple[str, list[dict[str, Any]]]:
            delta = parser.finish() if text is None else parser.feed(text)
            return delta.content, delta.tool_calls

        return feed


def _tool_reader(job: GenerationJob, tool_parser: str | None) -> _ToolReader | None:
    if job.kind != CHAT or not job.tools:
        return None
    if job.forced_tool_choice is not None:
        return _ToolReader(job.forced_tool_choice, None)
    return _ToolReader(None, tool_parser) if tool_parser else None


def _checked(result: CompletionResult) -> CompletionResult:
    if result.finish_reason == FinishReason.ERROR:
        raise from_final_error(result.error or "the server failed the request")
    return result


async def _generate_all(link: FrontendLink, job: GenerationJob) -> list[CompletionResult]:
    """Every input's final; the first failure fails them all (the others are aborted)."""
    try:
        if len(job.inputs) == 1:
            return [_checked(await link.client.generate(**job.inputs[0], **job.options))]
        tasks = [asyncio.ensure_future(link.client.generate(**inp, **job.options)) for inp in job.inputs]
        try:
            return [_checked(r) for r in await asyncio.gather(*tasks)]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    except ApiError:
        raise
    except Exception as exc:
        raise api_error(exc) from exc


async def _replies(link: FrontendLink, job: GenerationJob) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Every input's stream as ``(input index, delta)``, in arrival order. One input is
    iterated directly (the common case, no task in between); several are read by one task
    each into a queue, all cancelled when the consumer stops."""
    if len(job.inputs) == 1:
        async with aclosing(link.client.stream(**job.inputs[0], **job.options)) as stream:
            async for delta in stream:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, StreamDelta | BaseException]] = asyncio.Queue()

    async def pump(index: int, inputs: dict[str, Any]) -> None:
        try:
            async with aclosing(link.client.stream(**inputs, **job.options)) as stream:
                async for delta in stream:
                    queue.put_nowait((index, delta))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, inputs)) for i, inputs in enumerate(job.inputs)]
    try:
        while True:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(
    request: web.Request, link: FrontendLink, job: GenerationJob, enc: ChunkEncoder, prompts: _Prompts,
    headers: dict[str, str], tools: _ToolReader | None = None,
) -> web.StreamResponse:
    n = len(job.inputs)
    finals: list[CompletionResult | None] = [None] * n
    async with aclosing(_replies(link, job)) as replies:
        # Before the status: every input's first reply, or the refusal that fails the request.
        first: list[tuple[int, StreamDelta]] = []
        seen: set[int] = set()
        try:
            while len(seen) < n:
                index, delta = await anext(replies)
                if delta.result is not None:
                    _checked(delta.result)
                seen.add(index)
                first.append((index, delta))
        except ApiError:
            raise
        except Exception as exc:
            raise api_error(exc) from exc
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        request[STARTED_RESPONSE] = response  # a failure from here on cannot change the status
        await response.prepare(request)
        out = bytearray()
        if job.kind == CHAT:
            for index in range(n * job.n):
                out += enc.role(index)
        encode = _Encoder(job, enc, prompts, finals, out, tools)
        left = n
        try:
            for index, delta in first:
                left -= encode(index, delta)
            while left:
                if out:
                    await _write(request, response, bytes(out))
                    out.clear()
                index, delta = await anext(replies)
                left -= encode(index, delta)
        except ApiError as exc:
            out += enc.error(exc) + DONE
            await _write(request, response, bytes(out))
            return response
        except Exception as exc:
            out += enc.error(api_error(exc)) + DONE
            await _write(request, response, bytes(out))
            return response
    if job.include_usage:
        out += enc.usage(finals)  # type: ignore[arg-type]
    out += DONE
    await _write(request, response, bytes(out))
    await response.write_eof()
    return response


async def _write(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """Send ``data`` on the stream, waiting at most ``--http-body-timeout`` for a client that
    does not read (once the socket buffers are full): such a client's request is aborted (its
    connection closed, the handler cancelled, the AsyncClient's abort) instead of its replies
    piling up in this process for as long as it runs. This is the per-request bound that
    stands in for ``--client-send-queue``, which does not bound this process's connection."""
    timeout = request.app.get(BODY_TIMEOUT, BODY_TIMEOUT_S)
    try:
        await asyncio.wait_for(response.write(data), timeout)
    except asyncio.TimeoutError:
        counts = request.app.get(COUNTS)
        if counts is not None:
            counts.note("not_reading")
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError from None


class _Encoder:
    """Appends each delta's events to ``out``. The plain path (text only) is
    :meth:`ChunkEncoder.text`; a job with ``echo``, ``return_token_ids`` or continuous usage
    builds its chunks as dicts with those fields (:meth:`ChunkEncoder.chunk`). Input ``i``'s
    sequence ``j`` (``StreamDelta.index``) is choice ``i * n + j``; an input's final ends each of
    its choices (its ``finish_reason``), and continuous usage counts the input's tokens."""

    def __init__(
        self, job: GenerationJob, enc: ChunkEncoder, prompts: _Prompts, finals: list[CompletionResult | None], out: bytearray,
        tools: _ToolReader | None = None,
    ) -> None:
        self.enc, self.finals, self.out = enc, finals, out
        self.n = job.n
        self.started = [False] * (len(finals) * job.n)  # by choice
        self.tools = [tools.stream() for _ in self.started] if tools is not None else None  # by choice
        self.called = [False] * len(self.started)
        self.prompts = prompts
        self.token_ids = job.return_token_ids
        self.continuous = job.continuous_usage
        self.job = job
        self.logged = job.logprobs is not None or job.prompt_logprobs
        self.plain = not (self.token_ids or self.continuous or prompts.echoes is not None or self.logged)
        self.generated = [0] * len(finals)  # by input
        # Text offset of the next token of each choice (completions' logprobs), and each input's
        # prompt columns once a delta brought them (every choice's first chunk echoes them).
        self.offsets = [0] * len(self.started)
        self.prompt_rows: dict[int, dict[str, Any]] = {}

    def __call__(self, index: int, delta: StreamDelta) -> int:
        """1 when ``delta`` was input ``index``'s final (ApiError if that final is an error)."""
        if self.tools is not None:
            return self._tool_delta(index, delta)
        choice = index * self.n + delta.index
        if self.plain:
            if delta.text:
                self.out += self.enc.text(choice, delta.text)
        elif delta.text or delta.token_ids or not self.started[choice]:
            self.out += self._detailed(index, choice, delta)
        if delta.result is None:
            return 0
        self.finals[index] = result = _checked(delta.result)
        for seq in result.choices:
            self.out += self.enc.finish(index * self.n + seq.index, seq.finish_reason, None, self._usage(index))
        return 1

    def _tool_delta(self, index: int, delta: StreamDelta) -> int:
        """A chat with tools (plain otherwise): each choice's text through its own reader,
        content as it releases it, each call as one ``tool_calls`` delta; at the input's final
        each of its choices ends, ``finish_reason`` ``tool_calls`` where it made calls."""
        base = index * self.n
        if delta.text:
            self._tool_pieces(base + delta.index, delta.text)
        if delta.result is None:
            return 0
        self.finals[index] = result = _checked(delta.result)
        for seq in result.choices:
            choice = base + seq.index
            self._tool_pieces(choice, None)
            self.out += self.enc.finish(choice, _tool_finish(seq.finish_reason) if self.called[choice] else seq.finish_reason)
        return 1

    def _tool_pieces(self, choice: int, text: str | None) -> None:
        """Feed ``text`` (None: the end) to choice ``choice``'s reader; its chunks to :attr:`out`."""
        content, calls = self.tools[choice](text)  # type: ignore[index]
        if content:
            self.out += self.enc.text(choice, content)
        if calls:
            self.called[choice] = True
            self.out += self.enc.chunk(choice, None, None, {"delta": {"tool_calls": calls}})

    def _detailed(self, index: int, choice: int, delta: StreamDelta) -> bytes:
        text = delta.text
        extra: dict[str, Any] = {}
        first = not self.started[choice]
        if first:
            self.started[choice] = True
            if self.prompts.echoes is not None:
                text = self.prompts.echoes[index] + text
            if self.token_ids and self.enc.kind != CHAT:
                extra["prompt_token_ids"] = self.prompts.ids[index]  # type: ignore[index]
        if self.token_ids:
            extra["token_ids"] = list(delta.token_ids)
        if self.logged:
            prompt_rows = delta.prompt_logprobs
            if prompt_rows is not None:
                self.prompt_rows[index] = prompt_rows
            elif first:  # n > 1: a sequence's first chunk after another's brought the prompt's
                prompt_rows = self.prompt_rows.get(index)
            fields = _logprob_fields(self.job, self.prompts, index, delta.logprobs, prompt_rows, self.offsets[choice], first)
            if fields.get("logprobs") and self.enc.kind == COMPLETION:
                self.offsets[choice] += sum(len(t) for t in fields["logprobs"]["tokens"])
            extra.update(fields)
        self.generated[index] += len(delta.token_ids)
        return self.enc.chunk(choice, text, None, extra, self._usage(index))

    def _usage(self, index: int) -> dict[str, int] | None:
        if not self.continuous:
            return None
        return usage_so_far(len(self.prompts.ids[index]), self.generated[index])  # type: ignore[index]
