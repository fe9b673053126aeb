"""Client-facing forms of profile snapshots: the protocol map of one process's snapshot
(:func:`profile_to_map`) and one Chrome/Perfetto trace across processes (:func:`chrome_trace`)."""

from __future__ import annotations

from typing import Any

from conveyor.ipc.messages import ProcessProfile
from conveyor.profiling.recorder import CLOCK_NAME


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
                events.append(
                    {"ph": "s", "name": "step", "cat": "step", "id": flow, "pid": pid, "tid": tid, "ts": start / 1000.0}
                )
            elif (role, span) in FLOW_TO:
                events.append(
                    {
                        "ph": "f",
                        "bp": "e",
                        "name": "step",
                        "cat": "step",
                        "id": flow,
                        "pid": pid,
                        "tid": tid,
                        "ts": start / 1000.0,
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"clock": CLOCK_NAME}}
