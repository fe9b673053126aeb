"""Cheap per-process latency recorders: stage timers, value series, counters and trace spans.

Every process of a server (frontend, scheduler, worker) owns one :class:`Profiler` and
records into it from its hot loop; a ``profile`` request asks each for a snapshot
(:class:`conveyor.ipc.messages.ProcessProfile`) with percentiles over a recent window and,
on demand, the raw spans for one Chrome/Perfetto timeline across all processes.

Clock: every timestamp is ``time.monotonic_ns()``, i.e. CLOCK_MONOTONIC on Linux. That clock
is one counter for the whole machine (time since boot, never stepped by NTP or a wall-clock
change), so spans recorded by different processes of one server, which always share a host
(their sockets are ``ipc://``), line up on one timeline without any offset exchange.
``perf_counter`` happens to read the same clock on Linux but Python documents it only as
per-process, so it is not used. Wall time is derived when needed from the
``wall_offset_ns`` each snapshot carries.

Cost model: recording is a handful of stores into preallocated Python lists used as rings
(no allocation, no numpy, no lock: each process records from its one loop thread), about
half a microsecond per span; a disabled profiler hands out shared no-op recorders.
Percentiles are computed with numpy only when a snapshot is asked for.

Invariants:
- Rings are bounded: a timer or series keeps its newest ``capacity`` samples, the trace its
  newest ``trace_capacity`` spans. A summary says how many samples it used (``count``) and
  how much time they cover (``span_s``), so a wrapped ring is visible, never silent.
- Timestamps stored in one ring are non-decreasing (they are "now" when recorded), which
  lets a window be found by scanning back from the newest sample.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from conveyor.ipc.messages import (
    CounterSummary,
    MetricSummary,
    ProcessProfile,
    SeriesSamples,
    TraceEvents,
)

now_ns = time.monotonic_ns
CLOCK_NAME = "CLOCK_MONOTONIC"

DEFAULT_CAPACITY = 4096
DEFAULT_TRACE_CAPACITY = 32768
MAX_WINDOW_S = 3600.0
# Counters keep one bucket per second for this many seconds: rates over any window up to it.
COUNTER_HORIZON_S = 3600

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000


class _Ring:
    """The newest ``capacity`` (timestamp, value) pairs; the oldest is overwritten."""

    __slots__ = ("name", "unit", "capacity", "_ts", "_val", "_next", "_count")

    def __init__(self, name: str, unit: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.name = name
        self.unit = unit
        self.capacity = capacity
        self._ts: list[int] = [0] * capacity
        self._val: list[float] = [0] * capacity
        self._next = 0
        self._count = 0  # samples ever recorded

    def _put(self, ts: int, value: float) -> None:
        i = self._next
        self._ts[i] = ts
        self._val[i] = value
        self._next = i + 1 if i + 1 < self.capacity else 0
        self._count += 1

    def samples(self, since_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """Timestamps and values recorded at or after ``since_ns``, oldest first."""
        held = min(self._count, self.capacity)
        if held == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        start = (self._next - held) % self.capacity
        order = np.arange(start, start + held) % self.capacity
        ts = np.asarray(self._ts, dtype=np.int64)[order]
        values = np.asarray(self._val, dtype=np.float64)[order]
        first = int(np.searchsorted(ts, since_ns, side="left"))
        return ts[first:], values[first:]

    def _scale(self) -> float:
        return 1.0

    def summary(self, since_ns: int) -> MetricSummary:
        ts, values = self.samples(since_ns)
        values = values * self._scale()
        if len(values) == 0:
            return MetricSummary(self.name, self.unit, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
        span = (int(ts[-1]) - int(ts[0])) / NS_PER_S
        return MetricSummary(
            self.name,
            self.unit,
            len(values),
            float(values.mean()),
            p50,
            p90,
            p99,
            float(values.max()),
            float(values.sum()),
            span,
        )

    def window_total(self, since_ns: int) -> float:
        """Sum of the values in the window, in the summary's unit."""
        return float(self.samples(since_ns)[1].sum()) * self._scale()


class Timer(_Ring):
    """Durations of one stage, kept in nanoseconds, summarized in milliseconds.

    With a trace attached, every recorded span is also a trace event, with ``arg`` (e.g.
    the step id) as its one argument named ``arg_name``.
    """

    __slots__ = ("arg_name", "_trace", "_trace_id")

    def __init__(self, name: str, capacity: int, trace: _TraceRing | None, arg_name: str) -> None:
        super().__init__(name, "ms", capacity)
        self.arg_name = arg_name
        self._trace = trace
        self._trace_id = trace.intern(name, arg_name) if trace is not None else -1

    def _scale(self) -> float:
        return 1.0 / NS_PER_MS

    def record(self, start_ns: int, end_ns: int | None = None, arg: int = -1) -> int:
        """Record the span ``start_ns .. end_ns`` (end defaults to now); returns the end."""
        if end_ns is None:
            end_ns = now_ns()
        self._put(end_ns, end_ns - start_ns)
        if self._trace is not None:
            self._trace.add(self._trace_id, start_ns, end_ns - start_ns, arg)
        return end_ns

    def window_total(self, since_ns: int) -> float:
        """Time spent in this stage inside the window (ms): a span that began before it counts
        only from ``since_ns`` on, so a long wait that merely ends in the window (the worker's
        idle wait for the first plan after a quiet spell) does not count as if it were in it."""
        ts, values = self.samples(since_ns)
        return float(np.minimum(values, ts - since_ns).sum()) * self._scale()

    @contextmanager
    def span(self, arg: int = -1) -> Iterator[None]:
        """``with timer.span(): ...`` records the block; prefer :meth:`record` in hot loops."""
        start = now_ns()
        try:
            yield
        finally:
            self.record(start, arg=arg)


class Series(_Ring):
    """Values of one quantity sampled over time (batch size, per-request latency in ms)."""

    __slots__ = ()

    def add(self, value: float, ts_ns: int | None = None) -> None:
        self._put(now_ns() if ts_ns is None else ts_ns, value)

    def raw(self, since_ns: int) -> SeriesSamples:
        ts, values = self.samples(since_ns)
        return SeriesSamples(self.name, self.unit, ts.tolist(), values.tolist())


class Counter:
    """A monotone count with one bucket per second, so its rate over any recent window is exact."""

    __slots__ = ("name", "total", "_buckets", "_second", "_born_ns")

    def __init__(self, name: str) -> None:
        self.name = name
        self.total = 0
        self._buckets = [0] * COUNTER_HORIZON_S
        self._born_ns = now_ns()
        self._second = self._born_ns // NS_PER_S

    def add(self, n: int = 1) -> None:
        self.total += n
        second = now_ns() // NS_PER_S
        if second != self._second:
            self._advance(second)
        self._buckets[second % COUNTER_HORIZON_S] += n

    def _advance(self, second: int) -> None:
        """Zero the buckets of the seconds that passed with no event (at most the whole ring)."""
        for s in range(self._second + 1, min(second, self._second + COUNTER_HORIZON_S) + 1):
            self._buckets[s % COUNTER_HORIZON_S] = 0
        self._second = second

    def summary(self, window_s: float, now: int) -> CounterSummary:
        second = now // NS_PER_S
        if second != self._second:
            self._advance(second)
        # Whole seconds before the current one, plus the current partial second.
        full = max(0, min(int(window_s), COUNTER_HORIZON_S - 1))
        count = sum(self._buckets[(second - k) % COUNTER_HORIZON_S] for k in range(full + 1))
        covered = min(full + (now % NS_PER_S) / NS_PER_S, (now - self._born_ns) / NS_PER_S)
        return CounterSummary(self.name, self.total, count / covered if covered > 0 else 0.0)


class _TraceRing:
    """The newest ``capacity`` spans of one process, names interned to small ints."""

    __slots__ = ("capacity", "names", "arg_names", "_index", "_name", "_start", "_dur", "_arg", "_next", "_count")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.names: list[str] = []
        self.arg_names: list[str] = []
        self._index: dict[str, int] = {}
        self._name = [0] * capacity
        self._start = [0] * capacity
        self._dur = [0] * capacity
        self._arg = [0] * capacity
        self._next = 0
        self._count = 0

    def intern(self, name: str, arg_name: str) -> int:
        if name not in self._index:
            self._index[name] = len(self.names)
            self.names.append(name)
            self.arg_names.append(arg_name)
        return self._index[name]

    def add(self, name_id: int, start_ns: int, dur_ns: int, arg: int) -> None:
        i = self._next
        self._name[i] = name_id
        self._start[i] = start_ns
        self._dur[i] = dur_ns
        self._arg[i] = arg
        self._next = i + 1 if i + 1 < self.capacity else 0
        self._count += 1

    def events(self, since_ns: int) -> TraceEvents:
        """Spans that end at or after ``since_ns``, in recording order (ends are non-decreasing)."""
        held = min(self._count, self.capacity)
        start = (self._next - held) % self.capacity
        order = [(start + k) % self.capacity for k in range(held)]
        keep = [i for i in order if self._start[i] + self._dur[i] >= since_ns]
        return TraceEvents(
            list(self.names),
            list(self.arg_names),
            [self._name[i] for i in keep],
            [self._start[i] for i in keep],
            [self._dur[i] for i in keep],
            [self._arg[i] for i in keep],
        )


class _NullTimer:
    """What a disabled profiler hands out: same interface, records nothing."""

    def record(self, start_ns: int, end_ns: int | None = None, arg: int = -1) -> int:
        return start_ns if end_ns is None else end_ns

    @contextmanager
    def span(self, arg: int = -1) -> Iterator[None]:
        yield


class _NullSeries:
    def add(self, value: float, ts_ns: int | None = None) -> None:
        pass


class _NullCounter:
    total = 0

    def add(self, n: int = 1) -> None:
        pass


_NULL_TIMER = _NullTimer()
_NULL_SERIES = _NullSeries()
_NULL_COUNTER = _NullCounter()


class Profiler:
    """One process's recorders, registered by name, and its snapshots.

    Register recorders once at startup (``timer``, ``series``, ``counter``) and keep the
    handles: recording through a handle costs no lookup. ``derive`` adds a value computed
    at snapshot time from the window (e.g. the worker's idle fraction).
    """

    def __init__(
        self,
        process: str,
        enabled: bool = True,
        capacity: int = DEFAULT_CAPACITY,
        trace_capacity: int = DEFAULT_TRACE_CAPACITY,
    ) -> None:
        self.process = process
        self.enabled = enabled
        self.capacity = capacity
        self.pid = os.getpid()
        self.tid = threading.get_native_id()
        self.started_ns = now_ns()
        self._trace = _TraceRing(trace_capacity) if enabled and trace_capacity > 0 else None
        self._rings: dict[str, _Ring] = {}
        self._counters: dict[str, Counter] = {}
        self._derived: dict[str, Callable[[int], float]] = {}

    def timer(self, name: str, *, trace: bool = True, arg_name: str = "", capacity: int | None = None) -> Timer:
        """A stage timer; ``trace=False`` keeps per-token stages out of the bounded trace."""
        if not self.enabled:
            return _NULL_TIMER  # type: ignore[return-value]
        self._check_new(name)
        timer = Timer(name, capacity or self.capacity, self._trace if trace else None, arg_name)
        self._rings[name] = timer
        return timer

    def series(self, name: str, unit: str, *, capacity: int | None = None) -> Series:
        if not self.enabled:
            return _NULL_SERIES  # type: ignore[return-value]
        self._check_new(name)
        series = Series(name, unit, capacity or self.capacity)
        self._rings[name] = series
        return series

    def counter(self, name: str) -> Counter:
        if not self.enabled:
            return _NULL_COUNTER  # type: ignore[return-value]
        if name in self._counters:
            raise ValueError(f"counter {name!r} registered twice")
        counter = self._counters[name] = Counter(name)
        return counter

    def derive(self, name: str, compute: Callable[[int], float]) -> None:
        """A value computed at snapshot time by ``compute(window_start_ns)``."""
        if self.enabled:
            self._derived[name] = compute

    def window_total(self, name: str, since_ns: int) -> float:
        """Sum over the window of a registered timer (ms) or series; 0 when disabled or unknown."""
        ring = self._rings.get(name)
        return ring.window_total(since_ns) if ring is not None else 0.0

    def _check_new(self, name: str) -> None:
        if name in self._rings:
            raise ValueError(f"recorder {name!r} registered twice")

    def snapshot(self, window_s: float, *, trace: bool = False, series: list[str] | tuple[str, ...] = ()) -> ProcessProfile:
        """Summaries over the last ``window_s`` seconds, plus spans and raw series if asked."""
        window_s = min(max(window_s, 0.0), MAX_WINDOW_S)
        now = now_ns()
        since = now - int(window_s * NS_PER_S)
        wall_offset = time.time_ns() - now_ns()
        metrics = [ring.summary(since) for ring in self._rings.values()]
        counters = [c.summary(window_s, now) for c in self._counters.values()]
        values = {name: float(compute(since)) for name, compute in self._derived.items()}
        raw = []
        for name in series:
            ring = self._rings.get(name)
            if isinstance(ring, Series):
                raw.append(ring.raw(since))
        events = self._trace.events(since) if trace and self._trace is not None else None
        return ProcessProfile(
            process=self.process,
            pid=self.pid,
            tid=self.tid,
            enabled=self.enabled,
            now_ns=now,
            wall_offset_ns=wall_offset,
            uptime_s=(now - self.started_ns) / NS_PER_S,
            window_s=window_s,
            metrics=metrics,
            counters=counters,
            values=values,
            series=raw,
            trace=events,
        )


# ---------------------------------------------------------------- client-facing forms


def profile_to_map(p: ProcessProfile) -> dict[str, Any]:
    """The client-protocol map of one process's snapshot (docs/protocol.md, ``profile``)."""
    out: dict[str, Any] = {
        "process": p.process,
        "pid": p.pid,
        "tid": p.tid,
        "enabled": p.enabled,
        "now_ns": p.now_ns,
        "wall_offset_ns": p.wall_offset_ns,
        "uptime_s": p.uptime_s,
        "window_s": p.window_s,
        "metrics": {
            m.name: {
                "unit": m.unit,
                "count": m.count,
                "mean": m.mean,
                "p50": m.p50,
                "p90": m.p90,
                "p99": m.p99,
                "max": m.max,
                "total": m.total,
                "span_s": m.span_s,
            }
            for m in p.metrics
        },
        "counters": {c.name: {"total": c.total, "rate": c.rate} for c in p.counters},
        "values": dict(p.values),
        "series": {s.name: {"unit": s.unit, "ts_ns": s.ts_ns, "values": s.values} for s in p.series},
        "trace": None,
    }
    if p.trace is not None:
        t = p.trace
        out["trace"] = {
            "names": t.names,
            "arg_names": t.arg_names,
            "name_index": t.name_index,
            "start_ns": t.start_ns,
            "dur_ns": t.dur_ns,
            "arg": t.arg,
        }
    return out


# Spans whose arg is a step id and which start a step's journey (scheduler) or receive it
# (worker): chrome_trace links them with flow arrows so one step can be followed across.
FLOW_FROM = {("scheduler", "plan_round_trip")}
FLOW_TO = {("worker", "execute")}


def chrome_trace(processes: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome/Perfetto JSON trace (``traceEvents``) from the ``processes`` of a profile reply.

    Times are microseconds of CLOCK_MONOTONIC, shared by all processes, so the spans of the
    frontend, scheduler and worker interleave exactly as they ran. A step's scheduler
    ``plan_round_trip`` span and the worker's ``execute`` span of the same step are joined
    by a flow arrow (id = step id, scoped by data-parallel replica: replica i's processes are
    ``scheduler.i`` and ``worker.i``, and their step ids count from 1 like replica 0's).
    """
    events: list[dict[str, Any]] = []
    for order, proc in enumerate(processes):
        pid, tid, name = proc["pid"], proc["tid"], proc["process"]
        role, _, replica = name.partition(".")  # "worker.1" -> ("worker", "1"); "worker" -> replica ""
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": tid, "args": {"name": f"{name} ({pid})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": order}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"{name} loop"}})
        trace = proc.get("trace")
        if not trace:
            continue
        names, arg_names = trace["names"], trace["arg_names"]
        for idx, start, dur, arg in zip(trace["name_index"], trace["start_ns"], trace["dur_ns"], trace["arg"]):
            span = names[idx]
            event: dict[str, Any] = {
                "ph": "X",
                "name": span,
                "cat": name,
                "pid": pid,
                "tid": tid,
                "ts": start / 1000.0,
                "dur": dur / 1000.0,
            }
            if arg >= 0 and arg_names[idx]:
                event["args"] = {arg_names[idx]: arg}
            events.append(event)
            if arg < 0:
                continue
            flow = f"{replica or 0}:{arg}"
            if (role, span) in FLOW_FROM:
                events.append({"ph": "s", "name": "step", "cat": "step", "id": flow, "pid": pid, "tid": tid, "ts": start / 1000.0})
            elif (role, span) in FLOW_TO:
                events.append(
                    {"ph": "f", "bp": "e", "name": "step", "cat": "step", "id": flow, "pid": pid, "tid": tid, "ts": start / 1000.0}
                )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"clock": CLOCK_NAME}}


# ---------------------------------------------------------------------- per-step records

# The worker's per-step record (behind --profile): one sample of each series per step, all
# stamped with the same timestamp (the step's end), so sample i of every series is one step.
# The shape is what a step's cost depends on (conveyor_tools.sim fits a cost model to it).
STEP_SHAPE_SERIES: tuple[str, ...] = (
    "step_prefill_tokens",  # tokens of requests with more than one token scheduled
    "step_decode_seqs",  # requests with exactly one token scheduled
    "step_context_tokens",  # sum over the plan of (computed + scheduled): attention's reach
    "step_copied_blocks",  # swap-outs + swap-ins + block copies
)
STEP_TIME_SERIES = "step_time"  # ms the worker was busy with the step (StepRecorder says which)
STEP_SERIES: tuple[str, ...] = (*STEP_SHAPE_SERIES, STEP_TIME_SERIES)
STEP_CAPACITY = 1 << 16


def plan_shape(plan: Any) -> tuple[int, int, int, int]:
    """A :class:`~conveyor.ipc.messages.StepPlan`'s shape, in :data:`STEP_SHAPE_SERIES` order.

    The same counts as the scheduler's iteration log (``prefill_tokens``, ``decode_tokens``,
    ``context_tokens``, swap blocks), computed from the plan alone so the worker can record
    them beside its own step time and a simulator can price a plan it never ran."""
    cached = plan.cached_requests
    new = plan.new_requests
    scheduled = np.concatenate(
        [np.fromiter((r.num_scheduled_tokens for r in new), np.int64, len(new)), np.asarray(cached.num_scheduled_tokens, np.int64)]
    )
    computed = sum(r.num_computed_tokens for r in new) + int(np.asarray(cached.num_computed_tokens, np.int64).sum())
    multi = scheduled > 1
    copies = len(plan.swap_out) + len(plan.swap_in) + len(plan.copy_blocks)
    return int(scheduled[multi].sum()), int((~multi).sum()), computed + int(scheduled.sum()), copies


class StepRecorder:
    """Records each step's :func:`plan_shape` and busy time into the :data:`STEP_SERIES`.

    A step's busy time runs from when the worker read its plan, or when it finished the
    step before (whichever is later: a pipelined step is launched while the previous one
    still runs), to when its result was sent. Steps back to back thus tile the worker's
    busy time without overlap, which is what a simulator that runs one step after another
    must reproduce. A disabled profiler records nothing and ``enabled`` is False, so the
    caller skips computing the shape."""

    def __init__(self, prof: Profiler) -> None:
        self.enabled = prof.enabled
        self._series = [prof.series(name, "count", capacity=STEP_CAPACITY) for name in STEP_SHAPE_SERIES]
        self._series.append(prof.series(STEP_TIME_SERIES, "ms", capacity=STEP_CAPACITY))
        self._last_end_ns = 0

    def record(self, shape: tuple[int, int, int, int], received_ns: int, end_ns: int) -> None:
        start = max(received_ns, self._last_end_ns)
        self._last_end_ns = end_ns
        for series, value in zip(self._series, (*shape, (end_ns - start) / NS_PER_MS)):
            series.add(value, end_ns)


def step_records(processes: list[dict[str, Any]], since_ns: int = 0, until_ns: int | None = None) -> dict[str, list[float]]:
    """The worker's per-step records in a profile reply's ``processes`` (asked for with
    ``series=STEP_SERIES``), as columns by series name, steps ending in ``[since_ns, until_ns]``;
    empty columns when the worker recorded none (--no-profile). With data-parallel replicas,
    every worker's steps (``worker``, ``worker.1`` ...) are concatenated."""
    out: dict[str, list[float]] = {name: [] for name in STEP_SERIES}
    for proc in processes:
        if proc["process"].split(".")[0] != "worker":
            continue
        series = proc.get("series", {})
        if any(name not in series for name in STEP_SERIES):
            continue
        ts = np.asarray(series[STEP_TIME_SERIES]["ts_ns"], np.int64)
        keep = (ts >= since_ns) & (ts <= (until_ns if until_ns is not None else ts.max(initial=0)))
        for name in STEP_SERIES:
            out[name].extend(np.asarray(series[name]["values"], np.float64)[keep].tolist())
    return out
