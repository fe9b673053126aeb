"""Cheap per-process latency recorders: stage timers, value series, counters and trace spans.

Every process of a server (frontend, scheduler, worker) owns one :class:`Profiler` and
records into it from its hot loop; a ``profile`` request asks each for a snapshot
(:class:`conveyor.ipc.messages.ProcessProfile`) with percentiles over a recent window and,
on demand, the raw spans for one Chrome/Perfetto timeline across all processes.

The modules: :mod:`~conveyor.profiling.recorder` (the clock, the recorders and the
:class:`Profiler`), :mod:`~conveyor.profiling.exposition` (a snapshot's client-protocol map
and the Chrome trace) and :mod:`~conveyor.profiling.step_records` (the worker's per-step
series). Every name is re-exported here.
"""

from __future__ import annotations

from conveyor.profiling.exposition import (
    FLOW_FROM,
    FLOW_TO,
    chrome_trace,
    profile_to_map,
)
from conveyor.profiling.recorder import (
    CLOCK_NAME,
    COUNTER_HORIZON_S,
    DEFAULT_CAPACITY,
    DEFAULT_TRACE_CAPACITY,
    MAX_WINDOW_S,
    NS_PER_MS,
    NS_PER_S,
    Counter,
    Profiler,
    Series,
    Timer,
    now_ns,
)
from conveyor.profiling.step_records import (
    STEP_CAPACITY,
    STEP_SERIES,
    STEP_SHAPE_SERIES,
    STEP_TIME_SERIES,
    StepRecorder,
    plan_shape,
    step_records,
)

__all__ = [
    "CLOCK_NAME",
    "COUNTER_HORIZON_S",
    "Counter",
    "DEFAULT_CAPACITY",
    "DEFAULT_TRACE_CAPACITY",
    "FLOW_FROM",
    "FLOW_TO",
    "MAX_WINDOW_S",
    "NS_PER_MS",
    "NS_PER_S",
    "Profiler",
    "STEP_CAPACITY",
    "STEP_SERIES",
    "STEP_SHAPE_SERIES",
    "STEP_TIME_SERIES",
    "Series",
    "StepRecorder",
    "Timer",
    "chrome_trace",
    "now_ns",
    "plan_shape",
    "profile_to_map",
    "step_records",
]
