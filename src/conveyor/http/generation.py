"""``/v1/completions`` and ``/v1/chat/completions``: a :class:`GenerationJob` run through the
frontend link, answered whole or as server-sent events.

Each input of the job is one client-protocol request. Unstreamed, the answer waits for every
final; streamed, the response's status is decided before anything is sent: the stream waits
until every input has its first reply (a token, or a refusal), so a bad field, an unknown
model or a full queue is a 400 / 404 / 429 with the OpenAI error object, not a 200 that
turns into an error event. A failure after that (a process died) is sent as an error event
followed by ``[DONE]``.

Disconnects: the app runs with aiohttp's handler cancellation, so a client that goes away
cancels the handler; the cancellation reaches the AsyncClient call (or, for several
inputs, every task the handler started, which are always cancelled and awaited on the way
out), and the AsyncClient aborts its request at the server, which frees its KV blocks
within an iteration. Streams are closed deterministically (``aclosing``), never left to
the garbage collector.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from conveyor.client import CompletionResult, Delta
from conveyor.http.errors import ApiError, from_final_error
from conveyor.http.link import FrontendLink, api_error
from conveyor.http.openai_requests import CHAT, GenerationJob
from conveyor.http.openai_responses import DONE, ChunkEncoder, completion_body, json_encode, response_id
from conveyor.ipc.messages import FinishReason

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def respond(request: web.Request, link: FrontendLink, job: GenerationJob, model: str) -> web.StreamResponse:
    """The HTTP answer to ``job``; :class:`ApiError` for a failure known before it starts."""
    await link.require_started()
    rid = response_id(job.kind, uuid.uuid4().hex)
    created = int(time.time())
    if job.stream:
        return await _stream(request, link, job, ChunkEncoder(job.kind, rid, created, model, job.include_usage))
    results = await _generate_all(link, job)
    body = json_encode(completion_body(job.kind, rid, created, model, results))
    return web.Response(body=body, content_type="application/json")


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


async def _replies(link: FrontendLink, job: GenerationJob) -> AsyncIterator[tuple[int, Delta]]:
    """Every input's stream as ``(input index, delta)``, in arrival order. One input is
    iterated directly (the common case, no task in between); several are read by one task
    each into a queue, all cancelled when the consumer stops."""
    if len(job.inputs) == 1:
        async with aclosing(link.client.stream(**job.inputs[0], **job.options)) as stream:
            async for delta in stream:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()

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


async def _stream(request: web.Request, link: FrontendLink, job: GenerationJob, enc: ChunkEncoder) -> web.StreamResponse:
    n = len(job.inputs)
    finals: list[CompletionResult | None] = [None] * n
    async with aclosing(_replies(link, job)) as replies:
        # Before the status: every input's first reply, or the refusal that fails the request.
        first: list[tuple[int, Delta]] = []
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
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        out = bytearray()
        if job.kind == CHAT:
            for index in range(n):
                out += enc.role(index)
        left = n
        try:
            for index, delta in first:
                left -= _encode(enc, index, delta, finals, out)
            while left:
                if out:
                    await response.write(bytes(out))
                    out.clear()
                index, delta = await anext(replies)
                left -= _encode(enc, index, delta, finals, out)
        except ApiError as exc:
            out += enc.error(exc) + DONE
            await response.write(bytes(out))
            return response
        except Exception as exc:
            out += enc.error(api_error(exc)) + DONE
            await response.write(bytes(out))
            return response
    if job.include_usage:
        out += enc.usage(finals)  # type: ignore[arg-type]
    out += DONE
    await response.write(bytes(out))
    await response.write_eof()
    return response


def _encode(enc: ChunkEncoder, index: int, delta: Delta, finals: list[CompletionResult | None], out: bytearray) -> int:
    """Append ``delta``'s events to ``out``; 1 when it was its input's final (ApiError if
    that final is an error)."""
    if delta.text:
        out += enc.text(index, delta.text)
    if delta.result is None:
        return 0
    finals[index] = _checked(delta.result)
    out += enc.finish(index, delta.result.finish_reason)
    return 1
