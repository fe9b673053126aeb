"""Load generators for a running Conveyor server, through the real ZeroMQ client.

Offline: every request is submitted at once and the clock stops when the last completes.
Online: requests are streamed, each sent at its Poisson arrival time, and every token's
arrival is stamped on the client's clock.

After an offline run the server's own profile is read back (window = the run) for the
scheduler's per-step batch sizes, the occupancy timeline, measured where the batch is
formed. The server shares this host, so its CLOCK_MONOTONIC stamps and this process's
are one clock and the timeline aligns with the run without any offset guessing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from conveyor.client import AsyncClient
from conveyor.kernels.jit_compiles import COUNTER as JIT_COMPILES
from conveyor.profiling import STEP_SERIES, step_records
from conveyor_tools.bench.cpu import CpuMeter, CpuProbe, per_token_us
from conveyor_tools.bench.run_metrics import OfflineRun, OnlineRun, StreamTiming, Timeline
from conveyor_tools.bench.workloads import BenchRequest, Workload

WARMUP_REQUESTS = 4
# Scheduler counters whose change over an offline run is recorded (extra["scheduler_counters"]).
SCHEDULER_COUNTERS = (
    "num_steps", "spec_num_proposals", "spec_proposed_tokens", "spec_accepted_tokens", "spec_num_steps",
    "spec_num_limited_steps",
)  # fmt: skip
TIMELINE_SERIES = ["batch_seqs", "batch_tokens", "num_waiting"]
PROFILE_SLACK_S = 0.05
PROFILE_TRIES = 4


class RunFailed(RuntimeError):
    """A request came back wrong (error, or not exactly the tokens asked for)."""


async def _warmup(client: AsyncClient) -> None:
    """First forwards allocate and initialize; keep them out of the measured window."""
    await asyncio.gather(
        *[
            client.generate(token_ids=[11, 12, 13, 14], max_tokens=8, temperature=0, ignore_eos=True)
            for _ in range(WARMUP_REQUESTS)
        ]
    )


def _check(result: Any, expected: int) -> None:
    if result.finish_reason != "length" or len(result.token_ids) != expected:
        raise RunFailed(
            f"request {result.request_id}: finish_reason={result.finish_reason} with {len(result.token_ids)} "
            f"of {expected} tokens ({result.error})"
        )


async def run_offline(
    system: str,
    address: str,
    workload: Workload,
    progress: Any,
    timeout: float,
    cpu_probe: CpuProbe | None = None,
    *,
    warmup: Workload | None = None,
    reruns: Sequence[Workload] = (),
) -> OfflineRun:
    """Every request of ``workload`` at once, after a warm-up; with ``cpu_probe`` (the server's
    processes' CPU seconds) the run's CPU cost by process is in ``extra["cpu_s"]``.

    ``warmup``: the warm-up's requests (default: four 4-token prompts), e.g. the workload's
    own prompt lengths, so that what the timed window meets is compiled before it. Each of
    ``reruns`` (the workload's shapes with fresh tokens: no prefix-cache hits) is timed after
    it on the same server and the last is the run reported; ``extra["timed_runs"]`` keeps
    every window's throughput and the Triton kernels the worker compiled inside it (None where
    the worker counts none: not on CUDA, or --no-profile)."""
    async with AsyncClient(address, timeout=timeout) as client:
        if warmup is None:
            await _warmup(client)
        else:
            await asyncio.gather(*[_generate(client, req) for req in warmup.requests])
        windows = []
        for timed in (workload, *reruns):
            compiles_before = _compiles(await client.profile(PROFILE_SLACK_S))
            if hasattr(progress, "reset"):  # a tqdm bar: its count, rate and ETA are this window's alone
                progress.reset(total=len(timed.requests))
            run = await _timed_run(client, system, timed, progress, cpu_probe)
            compiles = _compiles(run.extra.pop("profile"))
            windows.append(
                {
                    "output_tok_s": run.summary()["output_tok_s"],
                    "wall_s": run.wall_s,
                    "triton_compiles": None if compiles is None else compiles - (compiles_before or 0),
                }
            )
    run.extra["timed_runs"] = windows
    return run


def _generate(client: AsyncClient, req: BenchRequest) -> Awaitable[Any]:
    return client.generate(
        token_ids=req.prompt_ids, max_tokens=req.output_len, temperature=0, ignore_eos=True, **req.sampling
    )


def _compiles(profile: dict[str, Any]) -> int | None:
    """The worker's count of Triton JIT compiles so far (conveyor.kernels.jit_compiles), or None."""
    worker = next((p for p in profile["processes"] if p["process"] == "worker"), None)
    counter = ((worker or {}).get("counters") or {}).get(JIT_COMPILES)
    return None if counter is None else int(counter["total"])


async def _timed_run(
    client: AsyncClient, system: str, workload: Workload, progress: Any, cpu_probe: CpuProbe | None
) -> OfflineRun:
    before = await client.stats()
    meter = CpuMeter(cpu_probe)
    start = time.perf_counter()
    start_mono = time.monotonic_ns()
    latencies = [0.0] * len(workload.requests)
    ttfts: list[float] = []

    async def one(i: int) -> None:
        req = workload.requests[i]
        result = await _generate(client, req)
        latencies[i] = time.perf_counter() - start
        _check(result, req.output_len)
        if result.timing.get("ttft") is not None:
            ttfts.append(result.timing["ttft"])
        progress.update(1)

    await asyncio.gather(*[one(i) for i in range(len(workload.requests))])
    wall = time.perf_counter() - start
    cpu_s = meter.stop()
    profile = await profile_of_run(client, start_mono, [*TIMELINE_SERIES, *STEP_SERIES])
    stats = await client.stats()
    # The worker's per-step records of the run (warmup excluded): conveyor-sim calibrate's input.
    steps = step_records(profile["processes"], start_mono, start_mono + int(wall * 1e9))
    return OfflineRun.of(
        system,
        workload,
        wall,
        latencies,
        ttfts,
        _server_timeline(profile, start_mono, wall),
        {
            "server_profile": _profile_summary(profile),
            "step_records": {**steps, "num_blocks": stats.get("total_blocks")},
            "scheduler_counters": counter_deltas(before, stats),
            "cpu_s": cpu_s,
            "profile": profile,  # popped by run_offline
        },
    )


async def profile_of_run(client: AsyncClient, start_mono_ns: int, series: list[str] | None = None) -> dict[str, Any]:
    """The server's profile over the run that began at ``start_mono_ns`` (CLOCK_MONOTONIC, which
    every process of a local server stamps with), so time-based values such as the worker's
    idle fraction describe the run, not the quiet spell before it. A process's window ends when
    it answers: a query delayed on a loaded machine would start its window after the run did
    (a 0.1 s run's window then held none of its steps). So the window is measured as the query
    leaves and, where an answer shows its window began after the run, asked again widened by
    twice the shortfall, a few times at most."""
    window = (time.monotonic_ns() - start_mono_ns) / 1e9 + PROFILE_SLACK_S
    for _ in range(PROFILE_TRIES):
        profile = await client.profile(window, series=series)
        late_ns = max(p["now_ns"] - int(p["window_s"] * 1e9) - start_mono_ns for p in profile["processes"])
        if late_ns <= 0:
            break
        window += 2 * late_ns / 1e9 + PROFILE_SLACK_S
    return profile


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the scheduler's step and speculative-decoding counters moved by between two
    ``stats`` replies (the measured window: warm-up excluded), the per-position list entry by entry."""
    out: dict[str, Any] = {name: after[name] - before[name] for name in SCHEDULER_COUNTERS if name in after}
    if "spec_accepted_per_position" in after:
        out["spec_accepted_per_position"] = [
            a - b for a, b in zip(after["spec_accepted_per_position"], before["spec_accepted_per_position"])
        ]
    return out


def _server_timeline(profile: dict[str, Any], start_mono_ns: int, wall_s: float) -> Timeline:
    """Per-step batch sizes from the scheduler's profile, as seconds since the run started."""
    sched = next((p for p in profile["processes"] if p["process"] == "scheduler"), None)
    series = (sched or {}).get("series", {}).get("batch_seqs")
    if not series:
        return Timeline(source="unavailable: the server was started with --no-profile")
    t, running = [], []
    for ts, value in zip(series["ts_ns"], series["values"]):
        offset = (ts - start_mono_ns) / 1e9
        if 0.0 <= offset <= wall_s:
            t.append(offset)
            running.append(value)
    return Timeline(t, running, "scheduler profile: sequences in each step's plan (batch_seqs)")


def _profile_summary(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile without raw series or spans: p50/p90/p99 per process and stage."""
    return {
        p["process"]: {"metrics": p["metrics"], "counters": p["counters"], "values": p["values"]}
        for p in profile["processes"]
    }


StreamOne = Callable[[BenchRequest, StreamTiming], Awaitable[None]]
#: An online run's way to the server, opened and warmed up: ``stream_one``, and what the run
#: adds to ``extra`` given the run's start (``time.monotonic_ns()``) and timings (read before
#: the face closes).
Face = tuple[StreamOne, Callable[[int, list[StreamTiming]], Awaitable[dict[str, Any]]]]


async def drive_arrivals(
    workload: Workload, arrivals: list[float], stream_one: StreamOne, progress: Any, cpu_probe: CpuProbe | None
) -> tuple[list[StreamTiming], float, dict[str, float]]:
    """Send every request of ``workload`` at its arrival time (seconds after the start) through
    ``stream_one``, which streams it and fills its timing (token stamps, ``num_tokens``,
    ``ok``). The one arrival loop of every online driver, whatever face it goes through.
    Returns the timings, the wall time and the server processes' CPU seconds over the run."""
    start = time.perf_counter()
    meter = CpuMeter(cpu_probe)
    timings: list[StreamTiming] = []

    async def one(i: int) -> None:
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        timing = StreamTiming(sent=time.perf_counter())
        timings.append(timing)
        await stream_one(workload.requests[i], timing)
        timing.finished = time.perf_counter()
        progress.update(1)

    await asyncio.gather(*[one(i) for i in range(len(workload.requests))])
    return timings, time.perf_counter() - start, meter.stop()


def online_run(
    system: str,
    rate: float,
    wall: float,
    timings: list[StreamTiming],
    slo_ttft_s: float,
    slo_tpot_s: float,
    cpu_s: dict[str, float],
    extra: dict[str, Any],
) -> OnlineRun:
    """An :class:`OnlineRun` of the requests that came back right, with the CPU per token."""
    output_tokens = sum(t.num_tokens for t in timings if t.ok)
    return OnlineRun(
        system=system,
        rate=rate,
        wall_s=wall,
        requests=timings,
        output_tokens=output_tokens,
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        extra={**extra, "cpu_s": cpu_s, "cpu_us_per_token": per_token_us(cpu_s, output_tokens)},
    )


async def run_online(
    system: str,
    address: str | None,
    workload: Workload,
    arrivals: list[float],
    rate: float,
    slo_ttft_s: float,
    slo_tpot_s: float,
    progress: Any,
    timeout: float,
    cpu_probe: CpuProbe | None = None,
    http_url: str | None = None,
) -> OnlineRun:
    """Stream every request of ``workload`` at its arrival time through the client protocol at
    ``address``, or with ``http_url`` through that server's OpenAI API
    (:func:`conveyor_tools.bench.http_driver.http_face`; the server profile is then read from
    ``address`` when given); ``cpu_probe`` (the server processes' CPU seconds) adds each
    process's CPU cost of the window to ``extra``."""
    if http_url is None:
        if address is None:
            raise ValueError("an online run through the client protocol needs its address")
        face = client_face(address, timeout)
    else:
        from conveyor_tools.bench.http_driver import http_face  # it builds on this module

        face = http_face(http_url, address, timeout)
    async with face as (stream_one, extra_of):
        start_mono = time.monotonic_ns()
        timings, wall, cpu_s = await drive_arrivals(workload, arrivals, stream_one, progress, cpu_probe)
        extra = await extra_of(start_mono, timings)
    return online_run(system, rate, wall, timings, slo_ttft_s, slo_tpot_s, cpu_s, extra)


@asynccontextmanager
async def client_face(address: str, timeout: float) -> AsyncIterator[Face]:
    """The client protocol at ``address`` (conveyor.client), warmed up; the run's extra is the
    server profile of its window."""
    async with AsyncClient(address, timeout=timeout) as client:
        await _warmup(client)

        async def stream_one(req: BenchRequest, timing: StreamTiming) -> None:
            last = None
            async for delta in client.stream(
                token_ids=req.prompt_ids, max_tokens=req.output_len, temperature=0, ignore_eos=True, **req.sampling
            ):
                now = time.perf_counter()
                if delta.token_ids:
                    timing.token_times.append(now)
                    timing.token_counts.append(len(delta.token_ids))
                    timing.num_tokens += len(delta.token_ids)
                last = delta
            result = last.result if last is not None else None
            timing.ok = result is not None and result.finish_reason == "length" and timing.num_tokens == req.output_len

        async def extra_of(start_mono: int, timings: list[StreamTiming]) -> dict[str, Any]:
            return {"server_profile": _profile_summary(await profile_of_run(client, start_mono))}

        yield stream_one, extra_of
