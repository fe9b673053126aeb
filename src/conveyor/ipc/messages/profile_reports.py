"""The profiling messages (tags 50-59): a ``profile`` query and the per-process snapshots
answering it."""

from __future__ import annotations

from msgspec import field

from conveyor.ipc.messages.tagged import Message, Positional, message

# ---------------------------------------------------------------- profiling (tags 50-59)
# A `profile` client call travels frontend -> scheduler -> worker as ProfileQuery; the worker
# answers the scheduler between steps with a ProfileReport of its own snapshot, and the
# scheduler forwards it to the frontend with its own snapshot added. Snapshots are built by
# conveyor.profiling; timestamps are CLOCK_MONOTONIC nanoseconds, one clock for every
# process of a server (they share a host).


class MetricSummary(Positional):
    """One timer or value series over a profile's window.

    Timers are in milliseconds (``unit == "ms"``); value series name their own unit.
    ``count`` samples fell in the window and cover ``span_s`` seconds, which is shorter than
    the window when the bounded ring wrapped (the figures then describe the newest samples).
    """

    name: str
    unit: str
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    total: float
    span_s: float


class CounterSummary(Positional):
    """A monotone count: ``total`` since the process started, ``rate`` per second over the window."""

    name: str
    total: int
    rate: float


class SeriesSamples(Positional):
    """Raw samples of one value series inside the window, oldest first (for timelines)."""

    name: str
    unit: str
    ts_ns: list[int]
    values: list[float]


class TraceEvents(Positional):
    """Complete spans inside the window, oldest first, as parallel columns.

    Span ``i`` is named ``names[name_index[i]]``, started at ``start_ns[i]`` and lasted
    ``dur_ns[i]``; ``arg[i]`` (-1 for none) is the value of ``arg_names[name_index[i]]``,
    e.g. the step id that links a scheduler span to the worker's spans of the same step.
    """

    names: list[str]
    arg_names: list[str]
    name_index: list[int]
    start_ns: list[int]
    dur_ns: list[int]
    arg: list[int]


class ProcessProfile(Positional):
    """One process's snapshot. ``now_ns`` is its CLOCK_MONOTONIC when taken;
    ``wall_offset_ns`` is ``time.time_ns() - now_ns`` then, to place the trace in wall time."""

    process: str
    pid: int
    tid: int
    enabled: bool
    now_ns: int
    wall_offset_ns: int
    uptime_s: float
    window_s: float
    metrics: list[MetricSummary]
    counters: list[CounterSummary]
    values: dict[str, float]
    series: list[SeriesSamples]
    trace: TraceEvents | None = None


@message
class ProfileQuery(Message, tag=50):
    """Ask for profile snapshots over the last ``window_s`` seconds; ``trace`` adds the spans,
    ``series`` names the value series whose raw samples to include."""

    query_id: str
    window_s: float
    trace: bool = False
    series: list[str] = field(default_factory=list)


@message
class ProfileReport(Message, tag=51):
    """Snapshots answering the ProfileQuery ``query_id``: the worker's alone, or the
    scheduler's followed by the worker's."""

    query_id: str
    profiles: list[ProcessProfile]
