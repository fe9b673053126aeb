"""The online load generator through the OpenAI HTTP API (``conveyor-http``).

The face :func:`conveyor_tools.bench.drivers.run_online` takes with ``http_url``: the same
seeded requests as through the client protocol, each a streamed
``POST /v1/completions`` with the workload's token ids as ``prompt``, ``max_tokens`` its
output length, ``ignore_eos`` and temperature 0, sent at its Poisson arrival time over
aiohttp's client (one session, connections kept alive and unlimited in number, so a
stream never waits for a connection). Times are stamped on this process's clock as the
server-sent events arrive, the way the ZeroMQ driver stamps deltas, so the two rows of a
run compare like for like.

What an event counts: the HTTP face sends one content event per delta that has text; a
delta whose text the detokenizer holds back (an incomplete UTF-8 sequence, say) sends no
event, and its token arrives with the next one. Each content event therefore counts as one
arrival of one token for the inter-token latencies, and the request's token count is the
``usage`` the stream ends with (``stream_options.include_usage``), which must equal the
output length asked for. TPOT, e2e and throughput use that count; only ITL sees the held
back tokens (as one longer gap), and ``extra`` records events per token so that is visible.

The load generator's own CPU time over the measured window is recorded too (with each server
process's, as the ZeroMQ driver does: :mod:`conveyor_tools.bench.cpu`): on a small machine it
shares the cores with the server, and a generator that costs much more per token than the
ZeroMQ one would understate the HTTP face.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec

from conveyor.client import AsyncClient
from conveyor_tools.bench.drivers import WARMUP_REQUESTS, Face, RunFailed, _profile_summary, profile_of_run
from conveyor_tools.bench.run_metrics import StreamTiming
from conveyor_tools.bench.workloads import BenchRequest

_DATA = b"data: "
_DONE = b"[DONE]"


class _Event(msgspec.Struct):
    """What the generator reads of a chunk (everything else is skipped by the decoder)."""

    choices: list[dict[str, Any]] = []
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


_decode_event = msgspec.json.Decoder(_Event).decode


def completion_body(model: str, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """The streamed ``/v1/completions`` body of one benchmark request."""
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The one model the server serves (``GET /v1/models``)."""
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timing: StreamTiming
) -> tuple[int | None, str | None]:
    """Send ``body`` and read its event stream, stamping ``timing``; returns the usage's
    completion tokens and the last finish reason (None, None if the stream ended without)."""
    completion_tokens = None
    finish_reason = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RunFailed(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(_DATA):
                continue  # the blank line that ends each event
            payload = line[len(_DATA) :].rstrip()
            if payload == _DONE:
                break
            now = time.perf_counter()
            event = _decode_event(payload)
            if event.error is not None:
                raise RunFailed(f"error event: {event.error.get('message')}")
            for choice in event.choices:
                if choice.get("text"):
                    timing.token_times.append(now)
                    timing.token_counts.append(1)
                if choice.get("finish_reason") is not None:
                    finish_reason = choice["finish_reason"]
            if event.usage is not None:
                completion_tokens = event.usage["completion_tokens"]
    return completion_tokens, finish_reason


@asynccontextmanager
async def http_face(base_url: str, profile_address: str | None, timeout: float) -> AsyncIterator[Face]:
    """``base_url``'s OpenAI API, warmed up, for :func:`conveyor_tools.bench.drivers.run_online`;
    the run's extra is the content events per token and, when ``profile_address`` is given,
    the server profile read from it over ZeroMQ."""
    url = f"{base_url}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        model = await served_model(session, base_url)
        warm = [StreamTiming(sent=0.0) for _ in range(WARMUP_REQUESTS)]
        await asyncio.gather(
            *[stream_completion(session, url, completion_body(model, [11, 12, 13, 14], 8), t) for t in warm]
        )
        events = 0

        async def stream_one(req: BenchRequest, timing: StreamTiming) -> None:
            nonlocal events
            tokens, reason = await stream_completion(
                session, url, completion_body(model, req.prompt_ids, req.output_len), timing
            )
            events += len(timing.token_times)
            timing.num_tokens = tokens or 0
            timing.ok = reason == "length" and tokens == req.output_len

        async def extra_of(start_mono: int, timings: list[StreamTiming]) -> dict[str, Any]:
            output_tokens = sum(t.num_tokens for t in timings if t.ok)
            extra: dict[str, Any] = {
                "base_url": base_url,
                "content_events_per_token": events / output_tokens if output_tokens else None,
            }
            if profile_address is not None:
                async with AsyncClient(profile_address, timeout=timeout) as client:
                    extra["server_profile"] = _profile_summary(await profile_of_run(client, start_mono))
            return extra

        yield stream_one, extra_of
