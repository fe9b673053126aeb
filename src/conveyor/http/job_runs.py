"""A :class:`GenerationJob` run at the frontend: every input's final (:func:`generate_all`) or
the stream of their deltas sent as server-sent events (:func:`stream_events`). This is the one
request lifecycle of the HTTP face; what the events say is the API's own (OpenAI's chunks in
:mod:`conveyor.http.generation`, Anthropic's in :mod:`conveyor.http.anthropic_responses`),
given as a :class:`StreamEncoder`.

Streamed, the response's status is decided before anything is sent: the stream waits until
every input has its first reply (a token, or a refusal), so a bad field, an unknown model or a
full queue is a 4xx with the API's error object, not a 200 that turns into an error event. A
failure after that (a process died) is sent as the encoder's error event.

Disconnects: the app runs with aiohttp's handler cancellation, so a client that goes away
cancels the handler; the cancellation reaches the AsyncClient call (or, for several inputs,
every task started here, which are always cancelled and awaited on the way out), and the
AsyncClient aborts its request at the server, which frees its KV blocks within an iteration.
Streams are closed deterministically (``aclosing``), never left to the garbage collector.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from aiohttp import web

from conveyor.client import CompletionResult, StreamDelta
from conveyor.http.connections import BODY_TIMEOUT, BODY_TIMEOUT_S, COUNTS
from conveyor.http.errors import ApiError, from_final_error
from conveyor.http.link import FrontendLink, api_error
from conveyor.http.openai_requests import GenerationJob
from conveyor.ipc.messages import FinishReason

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The request's key of a stream response that is prepared (its 200 sent): the error middleware
# answers a failure after that with the stream itself, never a second response.
STARTED_RESPONSE = "conveyor.started_response"


class StreamEncoder(Protocol):
    """An API's events for one streamed job, appended to :attr:`out` (sent between deltas)."""

    out: bytearray

    def start(self) -> None:
        """The events right after the status (before the first delta's)."""

    def __call__(self, index: int, delta: StreamDelta) -> int:
        """``delta`` of input ``index``; 1 when it was that input's final (ApiError if that
        final is an error)."""

    def fail(self, error: ApiError) -> None:
        """The events that end a stream failed after its status was sent."""

    def end(self) -> None:
        """The events that end a stream whose inputs all ended."""


def checked(result: CompletionResult) -> CompletionResult:
    if result.finish_reason == FinishReason.ERROR:
        raise from_final_error(result.error or "the server failed the request")
    return result


async def generate_all(link: FrontendLink, job: GenerationJob) -> list[CompletionResult]:
    """Every input's final; the first failure fails them all (the others are aborted)."""
    try:
        if len(job.inputs) == 1:
            return [checked(await link.client.generate(**job.inputs[0], **job.options))]
        tasks = [asyncio.ensure_future(link.client.generate(**inp, **job.options)) for inp in job.inputs]
        try:
            return [checked(r) for r in await asyncio.gather(*tasks)]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    except ApiError:
        raise
    except Exception as exc:
        raise api_error(exc) from exc


async def replies(link: FrontendLink, job: GenerationJob) -> AsyncIterator[tuple[int, StreamDelta]]:
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


async def stream_events(
    request: web.Request, link: FrontendLink, job: GenerationJob, encoder: StreamEncoder, headers: dict[str, str]
) -> web.StreamResponse:
    """``job`` streamed as ``encoder``'s events, its status decided by every input's first reply."""
    n = len(job.inputs)
    out = encoder.out
    async with aclosing(replies(link, job)) as deltas:
        # Before the status: every input's first reply, or the refusal that fails the request.
        first: list[tuple[int, StreamDelta]] = []
        seen: set[int] = set()
        try:
            while len(seen) < n:
                index, delta = await anext(deltas)
                if delta.result is not None:
                    checked(delta.result)
                seen.add(index)
                first.append((index, delta))
        except ApiError:
            raise
        except Exception as exc:
            raise api_error(exc) from exc
        response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        request[STARTED_RESPONSE] = response  # a failure from here on cannot change the status
        await response.prepare(request)
        encoder.start()
        left = n
        try:
            for index, delta in first:
                left -= encoder(index, delta)
            while left:
                if out:
                    await write(request, response, bytes(out))
                    out.clear()
                index, delta = await anext(deltas)
                left -= encoder(index, delta)
        except Exception as exc:
            encoder.fail(exc if isinstance(exc, ApiError) else api_error(exc))
            await write(request, response, bytes(out))
            return response
    encoder.end()
    await write(request, response, bytes(out))
    await response.write_eof()
    return response


async def write(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
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
