"""The recorders: stage timers, value series, counters and trace spans, and the
:class:`Profiler` that owns them and builds its process's snapshot.

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

    def snapshot(
        self, window_s: float, *, trace: bool = False, series: list[str] | tuple[str, ...] = ()
    ) -> ProcessProfile:
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
