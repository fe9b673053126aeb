"""conveyor-sim: the simulator drives the real scheduler exactly as the server loop does, the
fit recovers a known cost model, and the sweep finds the known cheapest configuration."""

from __future__ import annotations

import json
import math
from collections import deque

import numpy as np
import pytest

from conveyor.ipc import codec
from conveyor.profiling import STEP_SERIES, STEP_SHAPE_SERIES, Profiler, StepRecorder, now_ns, plan_shape
from conveyor.runtime.config import SchedulerConfig
from conveyor.scheduler.iteration_log import ITERATION_FIELDS
from conveyor_tools.cli import sim as sim_cli
from conveyor_tools.sim.cost import (
    FEATURES,
    CostModel,
    StepCost,
    expert_groups,
    fit,
    nonnegative_lstsq,
    peak_tokens,
    records_arrays,
)
from conveyor_tools.sim.simulator import SAMPLED_TOKEN, SimRequest, simulate
from tests.scheduler.scheduler_harness import Harness, make_prompt

# Tight on blocks and slots, so the replay preempts, chunks prompts and plans ahead.
CONFIG = SchedulerConfig(
    num_blocks=40,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=24,
    max_model_len=128,
    iteration_log_size=100_000,
)
COST = StepCost(0.004, {"prefill_tokens": 2e-4, "decode_seqs": 1e-3, "context_tokens": 1e-5})


def step_time(plan) -> float:
    return COST.time(plan_shape(plan))


def arrivals(n: int = 30, seed: int = 3) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(0.02, n)).round(4)
    times[5:9] = times[5]  # a burst arriving together
    out = []
    for i, t in enumerate(times.tolist()):
        rid = f"r{i}"
        out.append(SimRequest(t, make_prompt(rid, int(rng.integers(3, 40))), int(rng.integers(1, 30)), rid))
    return out


def harness_replay(requests: list[SimRequest]) -> Harness:
    """The same arrivals and step times through the scheduler-test harness (the FakeWorker
    checks every plan against the protocol), by an event loop written independently of the
    simulator's: plan in sync when nothing is in flight, then ahead when allowed."""
    h = Harness(CONFIG, worker_kwargs={"token_fn": lambda rid, pos: SAMPLED_TOKEN}, overlap=True)
    origin = h.clock.now
    ends: deque[float] = deque()

    def plan(now: float) -> None:
        if not h.inflight:
            p = h.schedule()
            if p is not None:
                ends.append(now + step_time(p))
        if h.inflight and h.scheduler.can_plan_ahead:
            p = h.schedule()
            if p is not None:
                ends.append(ends[-1] + step_time(p))

    pending = deque(sorted(requests, key=lambda r: r.arrival))
    while pending or h.inflight or h.scheduler.has_work():
        now = h.clock.now - origin
        if ends:
            next_end = ends[0]
        elif h.scheduler.has_work() and h.scheduler.seconds_until_ready() is not None:
            next_end = now + h.scheduler.seconds_until_ready() + 1e-9
        else:
            next_end = math.inf
        next_arrival = pending[0].arrival if pending else math.inf
        if next_end <= next_arrival:
            h.clock.now = origin + next_end
            if h.inflight:
                h.finish_step()
                ends.popleft()
            plan(next_end)
        else:
            h.clock.now = origin + next_arrival
            while pending and pending[0].arrival == next_arrival:
                r = pending.popleft()
                assert (
                    h.add(r.request_id, prompt=r.prompt_ids, max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                    is None
                )
            if not h.inflight:
                plan(next_arrival)
    h.check_idle()
    h.check_outcomes()
    return h


def test_simulator_decisions_equal_the_scheduler_driven_by_the_fake_worker():
    requests = arrivals()
    result = simulate(requests, CONFIG, step_time)
    h = harness_replay(requests)
    sim_plans = [s.plan for s in result.replicas[0].steps]
    assert len(sim_plans) == len(h.plans) > 50
    assert [codec.encode(p) for p in sim_plans] == [codec.encode(p) for p in h.plans]
    assert sum(p.planned_ahead for p in h.plans) > 10  # overlap exercised
    stats = result.replicas[0].scheduler.stats()
    assert stats["num_preemptions"] > 0 and stats["num_preemptions"] == h.scheduler.stats()["num_preemptions"]
    # The iteration logs agree field by field (times shifted by the harness clock's origin).
    skip = {ITERATION_FIELDS.index("schedule_us")}
    t = ITERATION_FIELDS.index("time")
    sim_rows, real_rows = result.replicas[0].scheduler.iterations.rows(), h.scheduler.iterations.rows()
    assert len(sim_rows) == len(real_rows)
    for a, b in zip(sim_rows, real_rows):
        b[t] -= 1000.0
        for i, (x, y) in enumerate(zip(a, b)):
            if i not in skip:
                assert x == pytest.approx(y, abs=1e-9), (ITERATION_FIELDS[i], a, b)
    # Every request got all its tokens; its first token and finish are step ends.
    ends = {s.end for s in result.replicas[0].steps}
    for r in result.requests:
        assert r.error is None and r.first_token in ends and r.finished in ends and r.first_token >= r.arrival


def test_plan_shape_is_the_iteration_logs_shape():
    h = harness_replay(arrivals(20, seed=5))
    f = {name: i for i, name in enumerate(ITERATION_FIELDS)}
    prefilled = varied = 0
    for plan, row in zip(h.plans, h.scheduler.iterations.rows()):
        shape = plan_shape(plan)
        assert shape[:4] == (
            row[f["prefill_tokens"]],
            row[f["decode_tokens"]],
            row[f["context_tokens"]],
            row[f["swap_out_blocks"]] + row[f["swap_in_blocks"]],
        )
        # Prefill attention: each multi-token request's new tokens times its reach, by hand.
        rows = [(r.num_computed_tokens, r.num_scheduled_tokens) for r in plan.new_requests]
        rows += list(zip(plan.cached_requests.num_computed_tokens, plan.cached_requests.num_scheduled_tokens))
        assert shape[4] == sum(n * (c + n) for c, n in rows if n > 1)
        decode_lengths = {math.floor(math.log(c + n) / math.log(1.25)) for c, n in rows if n == 1}
        assert shape[5] == len(decode_lengths)
        prefilled += shape[0] > 0
        varied += shape[5] > 1
    assert prefilled > 5 and varied > 5


def test_step_recorder_tiles_pipelined_steps():
    prof = Profiler("worker")
    rec = StepRecorder(prof)
    t0 = now_ns() - 10_000_000  # inside the snapshot's window
    rec.record((10, 0, 10, 0, 100, 0), received_ns=t0 + 1_000_000, end_ns=t0 + 5_000_000)
    rec.record((0, 2, 24, 0, 0, 1), received_ns=t0 + 3_000_000, end_ns=t0 + 8_000_000)  # read while step 1 ran
    snap = prof.snapshot(3600, series=list(STEP_SERIES))
    values = {s.name: s.values for s in snap.series}
    assert values["step_time"] == [4.0, 3.0]
    assert values["step_prefill_tokens"] == [10, 0] and values["step_context_tokens"] == [10, 24]
    assert values["step_prefill_attention"] == [100, 0] and values["step_decode_classes"] == [0, 1]
    assert not StepRecorder(Profiler("worker", enabled=False)).enabled


def synthetic_steps(n: int, rng: np.random.Generator, experts: tuple[int, int] | None = None) -> np.ndarray:
    """Features of ``n`` steps of one server: plan shapes, then their peak tokens and expert groups."""
    prefill = rng.integers(0, 512, n) * (rng.random(n) < 0.3)
    prefill[: n // 4] //= 4  # the run's first steps small: peaks keep coming for a while
    decode = rng.integers(0, 64, n)
    classes = np.minimum(decode, rng.integers(1, 12, n))
    shapes = np.column_stack(
        [prefill, decode, rng.integers(0, 20000, n), np.zeros(n), prefill * rng.integers(1, 600, n), classes]
    )
    return np.column_stack([shapes, peak_tokens(shapes), expert_groups(shapes[:, 0] + shapes[:, 1], experts)])


TRUTH = {"prefill_tokens": 3e-5, "decode_seqs": 2e-4, "context_tokens": 4e-7, "copied_blocks": 0.0,
         "prefill_attention": 1e-8,
         "decode_classes": 3e-4, "peak_tokens": 5e-5, "expert_groups": 4e-4}  # fmt: skip


def test_fit_recovers_known_coefficients(tmp_path):
    rng = np.random.default_rng(0)
    shapes = synthetic_steps(400, rng)
    times = 0.005 + shapes @ np.array([TRUTH[f] for f in FEATURES]) + rng.normal(0, 1e-5, len(shapes))
    cost = fit(shapes, times)
    assert cost.intercept_s == pytest.approx(0.005, rel=0.02)
    assert (shapes[:, -2] > 0).sum() >= 5
    for name in (
        "prefill_tokens",
        "decode_seqs",
        "context_tokens",
        "prefill_attention",
        "decode_classes",
        "peak_tokens",
    ):
        assert cost.coef_s[name] == pytest.approx(TRUTH[name], rel=0.05), name
    assert cost.coef_s["copied_blocks"] == cost.coef_s["expert_groups"] == 0.0  # never varied: none invented
    # The calibrate command finds the records in a bin/bench JSON and writes the same fit.
    records = {name: col.tolist() for name, col in zip(STEP_SHAPE_SERIES, shapes.T)}  # peaks: recomputed
    records["step_time"] = (times * 1e3).tolist()
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"systems": {"conveyor": {"extra": {"step_records": {**records, "num_blocks": 77}}}}}))
    out = tmp_path / "cost.json"
    assert sim_cli.main(["calibrate", str(bench), "--tp", "2", "--out", str(out)]) == 0
    model = CostModel.load(str(out))
    assert set(model.by_tp) == {2} and model.by_tp[2].num_blocks == 77
    for name in ("decode_seqs", "peak_tokens"):
        assert model.by_tp[2].coef_s[name] == pytest.approx(TRUTH[name], rel=0.05), name


def test_fit_is_nonnegative_ignores_spikes_and_keeps_the_total():
    """Steps slowed by another process (a few, 3 to 10x) do not bend the fit's shape: the
    coefficients keep the true proportions, scaled so the predicted total is the measured
    one; a feature that costs nothing, seen with noise only, gets 0, never a negative."""
    rng = np.random.default_rng(1)
    shapes = synthetic_steps(600, rng)
    truth = {**TRUTH, "context_tokens": 0.0}
    clean = 0.005 + shapes @ np.array([truth[f] for f in FEATURES])
    times = clean * rng.normal(1.0, 0.02, len(clean))
    spiked = rng.random(len(times)) < 0.04
    times[spiked] *= rng.uniform(3, 10, spiked.sum())
    cost = fit(shapes, times)
    assert cost.num_trimmed >= spiked.sum() and cost.num_trimmed < 2 * spiked.sum()
    predicted = np.array([cost.time(s[:-2], s[-2]) for s in shapes])
    assert predicted.sum() == pytest.approx(times.sum(), rel=1e-9)
    scale = times.sum() / clean.sum()
    assert cost.intercept_s == pytest.approx(0.005 * scale, rel=0.05)
    for name, rel in (
        ("prefill_tokens", 0.05),
        ("decode_seqs", 0.05),
        ("prefill_attention", 0.1),
        ("decode_classes", 0.1),
    ):
        assert cost.coef_s[name] == pytest.approx(truth[name] * scale, rel=rel), name
    assert 0.0 <= cost.coef_s["context_tokens"] < 2e-8  # 5 % of what TRUTH gives it elsewhere
    # Plain least squares on the same steps is what this replaces: the spikes bend it.
    design = np.column_stack([np.ones(len(times)), shapes[:, [0, 1, 2, 4, 5, 6]]])
    plain, *_ = np.linalg.lstsq(design, times, rcond=None)
    assert (
        abs(plain[1] / plain[0] - truth["prefill_tokens"] / 0.005) > 0.05 * truth["prefill_tokens"] / 0.005
        or plain[3] < 0
    )


def test_nonnegative_lstsq_matches_a_brute_force_optimum():
    rng = np.random.default_rng(2)
    design = np.column_stack([np.ones(50), rng.normal(size=(50, 3))])
    target = design @ np.array([1.0, 2.0, -3.0, 0.5]) + rng.normal(0, 0.1, 50)
    x = nonnegative_lstsq(design, target)
    assert (x >= 0).all() and x[2] == 0.0
    # No non-negative point nearby does better (KKT: the optimum of a convex problem).
    best = np.sum((design @ x - target) ** 2)
    for _ in range(2000):
        y = np.maximum(x + rng.normal(0, 0.05, 4), 0)
        assert np.sum((design @ y - target) ** 2) >= best - 1e-9


def test_sweep_picks_the_cheapest_configuration(tmp_path, capsys):
    # One step per token, whatever the batch: tp 1 is too slow per token for the TPOT bound,
    # tp 2 meets it, and at 10 req/s of 16-token outputs one tp-2 replica needs at least 8
    # slots (2 slots: 2 / 0.02 s / 16 tokens = 6.25 req/s). tp 4 also meets it, with 4 GPUs.
    model = CostModel({tp: StepCost(t, {}, num_blocks=4096) for tp, t in ((1, 0.05), (2, 0.02), (4, 0.01))})
    path = tmp_path / "cost.json"
    model.save(str(path))
    out = tmp_path / "sweep.json"
    argv = ["sweep", "--cost", str(path), "--workload", "fixed", "--prompt-len", "16", "--output-len", "16",
            "--num-requests", "200", "--rate", "10", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "30",
            "--tp", "1,2,4", "--dp", "1,2", "--max-num-seqs", "2,8", "--json", str(out)]  # fmt: skip
    assert sim_cli.main(argv) == 0
    best = json.loads(out.read_text())["cheapest"]
    assert (best["tp"], best["dp"], best["max_num_seqs"]) == (2, 1, 8)
    assert "cheapest: tp 2 x dp 1 = 2 GPUs, max_num_seqs 8" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert {(r["tp"], r["dp"]) for r in rows} == {(1, 1), (1, 2), (2, 1)}  # stops at 2 GPUs
    assert not any(r["meets"] for r in rows if r["tp"] == 1)
    # Without enough slots nothing with 2 GPUs meets 10 req/s, so data parallelism does.
    argv[argv.index("2,8")] = "2"
    assert sim_cli.main(argv) == 0
    best = json.loads(out.read_text())["cheapest"]
    assert best["gpus"] == 4 and best["tp"] in (2, 4)


def test_least_outstanding_routing_spreads_a_burst():
    cost = StepCost(0.01, {"decode_seqs": 1e-3})
    reqs = [SimRequest(0.0, make_prompt(f"q{i}", 8), 10, f"q{i}") for i in range(6)]
    result = simulate(reqs, CONFIG, cost, replicas=3)
    assert [sorted(rep.requests) for rep in result.replicas] == [["q0", "q3"], ["q1", "q4"], ["q2", "q5"]]
    one = simulate(reqs, CONFIG, cost, replicas=1)
    assert result.summary()["wall_s"] < one.summary()["wall_s"]


def test_each_replica_pays_its_own_warm_up_as_the_records_count_it():
    """A step's peak-token term is paid when it runs more tokens than any before it on its
    own server: the simulator's pricing, per replica, equals the cost model over the steps'
    records (the path a calibration takes), and a second wave of the same size pays none."""
    cost = StepCost(0.001, {"prefill_tokens": 1e-5, "decode_seqs": 1e-4, "peak_tokens": 1e-3})
    reqs = [SimRequest(0.0 if i < 6 else 5.0, make_prompt(f"w{i}", 12), 4, f"w{i}") for i in range(12)]
    result = simulate(reqs, CONFIG, cost, replicas=2)
    for rep in result.replicas:
        shapes = [plan_shape(s.plan) for s in rep.steps]
        records = {name: [float(x[i]) for x in shapes] for i, name in enumerate(STEP_SHAPE_SERIES)}
        records["step_time"] = [(s.end - s.start) * 1e3 for s in rep.steps]
        features, times = records_arrays(records)
        assert times == pytest.approx([cost.time(f[:-2], f[-2]) for f in features])
        peaks = features[:, -2]
        second = [i for i, s in enumerate(rep.steps) if s.start >= 5.0]
        assert peaks[0] > 0 and second and not peaks[second].any()
    assert peak_tokens(np.array([[10, 0], [0, 5], [16, 4], [20, 0], [3, 1]])).tolist() == [10, 0, 20, 0, 0]


def test_fit_takes_each_runs_load_as_a_level_not_as_a_features_cost():
    """Two runs, the second on a machine twice as loaded and with more length classes per
    step: pooled, the load lands on ``decode_classes``; fitted with each run at its own
    level, the coefficients keep the true proportions."""
    rng = np.random.default_rng(3)
    a, b = synthetic_steps(400, rng), synthetic_steps(400, rng)
    a[:, 5] = np.minimum(a[:, 1], 1)  # equal lengths: one class
    coefs = np.array([TRUTH[f] for f in FEATURES])
    times = np.concatenate([0.005 + a @ coefs, 2.0 * (0.005 + b @ coefs)]) * rng.normal(1.0, 0.01, 800)
    shapes, runs = np.concatenate([a, b]), np.repeat([0, 1], 400)
    leveled, pooled = fit(shapes, times, runs=runs), fit(shapes, times)
    ratio = TRUTH["decode_classes"] / TRUTH["decode_seqs"]
    assert leveled.coef_s["decode_classes"] / leveled.coef_s["decode_seqs"] == pytest.approx(ratio, rel=0.1)
    assert pooled.coef_s["decode_classes"] / max(pooled.coef_s["decode_seqs"], 1e-12) > 1.5 * ratio
    for cost in (leveled, pooled):  # either way the calibration's total is kept
        assert sum(cost.time(s[:-2], s[-2]) for s in shapes) == pytest.approx(times.sum(), rel=1e-9)


def test_decode_length_classes_follow_the_cpu_attentions_padding_bound():
    """``step_decode_classes`` prices the CPU attention's grouping: its ratio must be the bound
    the batched torch backend pads a group to (two constants, since the profiler is torch-free)."""
    from conveyor.profiling.step_records import LENGTH_CLASS_RATIO
    from conveyor.worker.attention.torch_batched import MAX_PADDING

    assert LENGTH_CLASS_RATIO == MAX_PADDING


def test_a_moe_models_expert_gemms_are_priced_per_active_expert(tmp_path):
    """Steps of a model of 64 experts, 8 per token: the fit recovers the cost per expert a
    step touches (E (1 - (1 - k/E)^N) for N tokens: 8 at one decode row, nearly 64 for a
    large prefill), calibrate --experts keeps (E, k), and pricing adds the term."""
    assert expert_groups(np.array([0, 1, 10_000]), (64, 8)).tolist() == pytest.approx([0.0, 8.0, 64.0])
    rng = np.random.default_rng(5)
    shapes = synthetic_steps(400, rng, experts=(64, 8))
    times = 0.005 + shapes @ np.array([TRUTH[f] for f in FEATURES]) + rng.normal(0, 1e-5, len(shapes))
    cost = fit(shapes, times, experts=(64, 8))
    assert cost.coef_s["expert_groups"] == pytest.approx(TRUTH["expert_groups"], rel=0.05)
    dense = StepCost(cost.intercept_s, {**cost.coef_s, "expert_groups": 0.0})
    decode_step = (0, 1, 50, 0, 0, 1)
    assert cost.time(decode_step) - dense.time(decode_step) == pytest.approx(8 * cost.coef_s["expert_groups"])
    records = {name: col.tolist() for name, col in zip(STEP_SHAPE_SERIES, shapes.T)}
    records["step_time"] = (times * 1e3).tolist()
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"extra": {"step_records": records}}))
    out = tmp_path / "cost.json"
    assert sim_cli.main(["calibrate", str(bench), "--out", str(out), "--experts", "64:8"]) == 0
    loaded = CostModel.load(str(out)).by_tp[1]
    assert loaded.experts == (64, 8)
    assert loaded.coef_s["expert_groups"] == pytest.approx(TRUTH["expert_groups"], rel=0.05)
