"""Seeded scheduler scenarios whose every plan and output must stay identical.

The scheduler's decisions (who runs, how much, which blocks and slots, who is preempted
and how, what is swapped) are deterministic given its inputs. These scenarios cover the
rules together: chunked prefill, preemption by recompute and by swap, the priority policy,
planning ahead, static batching with a gathered batch, the prefix cache with offloading,
aborts, failed steps and queue timeouts. Each is run through the scheduler and the fake
worker, and the trace (every plan, every output) is compared with the one committed in
``plan_traces.json``: a restructuring must not change a single decision.

When a change of behaviour is intended, regenerate the file
(``CONVEYOR_WRITE_TRACES=1 python3 -m pytest tests/scheduler/test_plan_traces.py``) and
review the diff of the traces it changed.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from conveyor.ipc.messages import StepPlan
from conveyor.runtime.config import SchedulerConfig
from tests import plans
from tests.scheduler.scheduler_harness import Harness

TRACE_FILE = Path(__file__).with_name("plan_traces.json")


def _plan_record(plan: StepPlan) -> list:
    return [
        plan.step_id,
        [
            [n.request_id, n.slot, list(n.token_ids), list(n.block_ids), n.num_computed_tokens, n.num_scheduled_tokens]
            for n in plan.new_requests
        ],
        [list(row) for row in plans.rows(plan.cached_requests)],
        list(plan.finished_slots),
        [list(p) for p in plan.swap_out],
        [list(p) for p in plan.swap_in],
        bool(plan.planned_ahead),
    ]


class TracingHarness(Harness):
    """A harness that also records every plan formed and every output, in order."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.trace: list = []

    def schedule(self):
        plan = super().schedule()
        if plan is not None:
            self.trace.append(["plan", _plan_record(plan)])
        return plan

    def record(self, outs) -> None:
        super().record(outs)
        for o in outs:
            self.trace.append(["out", o.request_id, list(o.new_token_ids), o.finish_reason, o.error])


def _drive(h: TracingHarness, rng: random.Random, arrivals: list[tuple], aborts: dict[int, list[str]]) -> None:
    """Add each ``(step, id, prompt_len, max_tokens, kwargs)`` arrival at its step, abort
    at theirs, and step until nothing is live."""
    pending = sorted(arrivals, key=lambda a: a[0])
    i = step = 0
    while i < len(pending) or h.scheduler.has_work() or h.inflight:
        while i < len(pending) and pending[i][0] <= step:
            _, rid, plen, mt, kw = pending[i]
            h.add(rid, plen, mt, **kw)
            i += 1
        if step in aborts:
            h.abort(*aborts[step])
        if h.step() is None and h.scheduler.has_work():
            wait = h.scheduler.seconds_until_ready()
            h.clock.advance((wait if wait is not None else 0.0) + 1e-6)
        h.clock.advance(rng.random() * 0.01)
        step += 1
        assert step < 5000, "no progress"


def _arrivals(rng: random.Random, n: int, spread: int, plen: tuple[int, int], mt: tuple[int, int], **kw) -> list:
    return [(rng.randrange(spread), f"r{k}", rng.randint(*plen), rng.randint(*mt), dict(kw)) for k in range(n)]


def _scenario(name: str) -> list:
    rng = random.Random(name)
    aborts: dict[int, list[str]] = {}
    worker: dict = {}
    overlap = False
    if name == "fcfs_chunked":
        cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=96)
        arrivals = _arrivals(rng, 24, 30, (1, 40), (1, 30))
    elif name == "recompute_tight":
        cfg = SchedulerConfig(
            num_blocks=20,
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            max_model_len=64,
            preemption="recompute",
        )
        arrivals = _arrivals(rng, 20, 20, (2, 20), (5, 30))
    elif name == "swap_overlap":
        cfg = SchedulerConfig(
            num_blocks=24,
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            max_model_len=64,
            preemption="swap",
            num_cpu_blocks=32,
        )
        arrivals = _arrivals(rng, 20, 20, (2, 20), (5, 30))
        overlap = True
    elif name == "priority_aging":
        cfg = SchedulerConfig(
            num_blocks=32,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=64,
            policy="priority",
            aging_rate=0.5,
            num_cpu_blocks=16,
        )
        arrivals = [
            (s, rid, p, m, {"priority": rng.randint(-3, 3)})
            for s, rid, p, m, _ in _arrivals(rng, 20, 25, (2, 24), (2, 20))
        ]
        overlap = True
    elif name == "static_batches":
        cfg = SchedulerConfig(
            num_blocks=48,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            batching="static",
            min_batch_size=4,
            max_wait_ms=50.0,
        )
        arrivals = _arrivals(rng, 14, 20, (1, 16), (1, 12))
    elif name == "prefix_offload":
        cfg = SchedulerConfig(
            num_blocks=24,
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            max_model_len=80,
            num_cpu_blocks=24,
            offload_evicted=True,
        )
        base = [1 + (7 * i) % 500 for i in range(40)]
        arrivals = [
            (
                rng.randrange(30),
                f"p{k}",
                0,
                rng.randint(1, 10),
                {"prompt": base[: rng.randint(4, 40)] + [rng.randint(1, 999) for _ in range(rng.randint(0, 6))]},
            )
            for k in range(18)
        ]
        overlap = True
    elif name == "aborts_failures_timeouts":
        cfg = SchedulerConfig(
            num_blocks=28,
            block_size=4,
            max_num_seqs=5,
            max_num_batched_tokens=20,
            max_model_len=64,
            max_waiting=12,
            max_queue_time=0.05,
            num_cpu_blocks=8,
        )
        arrivals = _arrivals(rng, 26, 30, (1, 24), (1, 20))
        aborts = {5: ["r3", "r7"], 11: ["r1", "r12", "nope"], 17: ["r20"]}
        worker = {"fail_steps": {6, 14, 15}, "eos_at": {"r2": 9, "r5": 12}}
        overlap = True
    else:
        raise KeyError(name)
    h = TracingHarness(cfg, worker_kwargs=worker, overlap=overlap)
    _drive(
        h,
        rng,
        [(s, rid, p, m, dict(kw, prompt=kw["prompt"]) if "prompt" in kw else kw) for s, rid, p, m, kw in arrivals],
        aborts,
    )
    h.check_idle()
    return h.trace


SCENARIOS = [
    "fcfs_chunked",
    "recompute_tight",
    "swap_overlap",
    "priority_aging",
    "static_batches",
    "prefix_offload",
    "aborts_failures_timeouts",
]


def test_traces_match_the_committed_ones():
    traces = {name: json.loads(json.dumps(_scenario(name))) for name in SCENARIOS}
    if os.environ.get("CONVEYOR_WRITE_TRACES"):
        TRACE_FILE.write_text(json.dumps(traces, separators=(",", ":")) + "\n")
        pytest.skip("traces written")
    committed = json.loads(TRACE_FILE.read_text())
    for name in SCENARIOS:
        got, want = traces[name], committed[name]
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{name}: event {i} differs:\n got  {g}\n want {w}"
        assert len(got) == len(want), f"{name}: {len(got)} events, the committed trace has {len(want)}"
