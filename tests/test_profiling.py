"""The per-process recorders: windows, ring wrap, rates, the disabled switch, the trace form."""

from __future__ import annotations

import time

import pytest

from conveyor import profiling
from conveyor.ipc import codec
from conveyor.ipc.messages import ProfileReport
from conveyor.profiling import NS_PER_MS, NS_PER_S, Profiler, chrome_trace, profile_to_map


def metric(profile, name):
    return next(m for m in profile.metrics if m.name == name)


def test_timer_percentiles_in_milliseconds() -> None:
    prof = Profiler("worker")
    forward = prof.timer("forward", arg_name="step")
    now = profiling.now_ns()
    for i in range(1, 101):  # durations 1..100 ms, all ending now
        forward.record(now - i * NS_PER_MS, now, arg=i)
    m = metric(prof.snapshot(60.0), "forward")
    assert m.unit == "ms" and m.count == 100
    assert m.p50 == pytest.approx(50.5) and m.p90 == pytest.approx(90.1) and m.p99 == pytest.approx(99.01)
    assert m.max == pytest.approx(100.0) and m.total == pytest.approx(5050.0) and m.mean == pytest.approx(50.5)


def test_window_excludes_old_samples_and_ring_keeps_newest() -> None:
    prof = Profiler("scheduler", capacity=8)
    batch = prof.series("batch_seqs", "seqs")
    now = profiling.now_ns()
    batch.add(1000.0, ts_ns=now - 120 * NS_PER_S)  # outside a 60 s window
    for v in range(20):  # wraps the ring of 8: only 12..19 remain
        batch.add(float(v), ts_ns=now - (20 - v) * NS_PER_MS)
    snap = prof.snapshot(60.0, series=["batch_seqs"])
    m = metric(snap, "batch_seqs")
    assert m.count == 8 and m.max == 19.0 and m.p50 == pytest.approx(15.5)
    assert snap.series[0].values == [float(v) for v in range(12, 20)]
    assert snap.series[0].ts_ns == sorted(snap.series[0].ts_ns)
    assert 0 < m.span_s < 0.01  # the newest 8 samples cover 7 ms: a wrapped ring is visible


def test_counter_rate_over_window() -> None:
    prof = Profiler("frontend")
    msgs = prof.counter("messages")
    msgs.add(50)
    msgs.add(50)
    time.sleep(0.05)
    c = prof.snapshot(60.0).counters[0]
    assert c.total == 100
    # All 100 happened within the process's short life: the rate is over that life, not 60 s.
    assert c.rate > 100 / 60.0 * 10


def test_derived_values_and_window_total() -> None:
    prof = Profiler("worker")
    busy, idle = prof.timer("execute"), prof.timer("idle")
    now = profiling.now_ns()
    busy.record(now - 30 * NS_PER_MS, now)
    idle.record(now - 10 * NS_PER_MS, now)
    prof.derive(
        "idle_fraction",
        lambda since: (
            prof.window_total("idle", since) / (prof.window_total("idle", since) + prof.window_total("execute", since))
        ),
    )
    assert prof.snapshot(60.0).values["idle_fraction"] == pytest.approx(0.25)


def test_window_total_counts_only_the_part_of_a_span_inside_the_window() -> None:
    """A 10 s idle wait that ends inside a 1 s window adds 1 s to it, not 10 (else a quiet
    spell before a benchmark run would show up as the worker waiting during the run)."""
    prof = Profiler("worker")
    idle = prof.timer("idle")
    now = profiling.now_ns()
    idle.record(now - 10 * NS_PER_S, now - 500 * NS_PER_MS)  # began long before the window
    idle.record(now - 200 * NS_PER_MS, now - 100 * NS_PER_MS)
    total = prof.window_total("idle", now - NS_PER_S)
    assert total == pytest.approx(500 + 100, rel=1e-6)


def test_disabled_profiler_records_nothing() -> None:
    prof = Profiler("worker", enabled=False)
    timer, series, counter = prof.timer("forward"), prof.series("s", "x"), prof.counter("c")
    assert timer.record(5, 10) == 10
    with timer.span():
        pass
    series.add(1.0)
    counter.add()
    snap = prof.snapshot(10.0, trace=True, series=["s"])
    assert not snap.enabled and snap.metrics == [] and snap.counters == [] and snap.series == []
    assert snap.trace is None


def test_duplicate_names_are_refused() -> None:
    prof = Profiler("worker")
    prof.timer("forward")
    with pytest.raises(ValueError):
        prof.series("forward", "x")


def test_trace_events_codec_and_chrome_form() -> None:
    sched, worker = Profiler("scheduler"), Profiler("worker")
    rt = sched.timer("plan_round_trip", arg_name="step")
    ex = worker.timer("execute", arg_name="step")
    quiet = worker.timer("per_token", trace=False)
    t0 = profiling.now_ns()
    ex.record(t0 + 1000, t0 + 5000, arg=7)
    rt.record(t0, t0 + 6000, arg=7)
    quiet.record(t0, t0 + 10)
    report = ProfileReport("q", [sched.snapshot(60.0, trace=True), worker.snapshot(60.0, trace=True)])
    decoded = codec.decode(codec.encode(report))
    assert decoded == report
    assert decoded.profiles[1].trace.names == ["execute"]  # per-token stages stay out of the trace
    maps = [profile_to_map(p) for p in decoded.profiles]
    assert maps[0]["metrics"]["plan_round_trip"]["count"] == 1
    events = chrome_trace(maps)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["name"], e["args"]["step"]) for e in spans} == {("plan_round_trip", 7), ("execute", 7)}
    assert {e["pid"] for e in spans} == {sched.pid}  # same process in this test; distinct in a server
    flows = sorted(e["ph"] for e in events if e.get("cat") == "step")
    assert flows == ["f", "s"]
    ex_span = next(e for e in spans if e["name"] == "execute")
    assert ex_span["ts"] == pytest.approx((t0 + 1000) / 1000.0) and ex_span["dur"] == pytest.approx(4.0)


def test_recording_is_cheap() -> None:
    """A loose bound (shared CI machines are noisy); the real figure is in docs/benchmarks.md."""
    prof = Profiler("worker")
    timer = prof.timer("forward", arg_name="step")
    n = 20000
    start = time.perf_counter()
    for i in range(n):
        timer.record(profiling.now_ns(), arg=i)
    per_call_us = (time.perf_counter() - start) / n * 1e6
    assert per_call_us < 20, per_call_us


def test_flows_join_each_replicas_own_steps() -> None:
    """With data-parallel replicas both count steps from 1: replica 1's processes
    (``scheduler.1``, ``worker.1``) get arrows of their own, never joined to replica 0's."""
    maps = []
    t0 = profiling.now_ns()
    for suffix in ("", ".1"):
        sched, worker = Profiler("scheduler" + suffix), Profiler("worker" + suffix)
        sched.timer("plan_round_trip", arg_name="step").record(t0, t0 + 6000, arg=3)
        worker.timer("execute", arg_name="step").record(t0 + 1000, t0 + 5000, arg=3)
        maps += [profile_to_map(sched.snapshot(60.0, trace=True)), profile_to_map(worker.snapshot(60.0, trace=True))]
    flows = [(e["ph"], e["id"]) for e in chrome_trace(maps)["traceEvents"] if e.get("cat") == "step"]
    assert sorted(flows) == [("f", "0:3"), ("f", "1:3"), ("s", "0:3"), ("s", "1:3")]
