#!/usr/bin/env python3
"""Scheduler cost per iteration: ``schedule()`` plus ``update()``, with a fake worker (a script, not a test).

The worker is a stand-in that samples a fixed token for every request due one; its own time
is not counted. What is measured is exactly the scheduler process's share of an iteration
apart from socket I/O: forming the plan and applying the result.

Scenarios, each at 64, 256 and 1024 requests in the system:

- ``decode``: every request is decoding (prompts of 128 tokens, outputs that never end within
  the run): the steady state of a busy server, and the case the per-iteration target is for.
- ``mixed``: a closed loop; prompts of 64..1024 tokens (half of them starting with a shared
  512-token system prompt, so admissions hit the prefix cache), outputs of 16..256 tokens,
  and every finished request replaced by a new one: each iteration has decodes, prefill
  chunks, admissions, retirements and prefix-cache lookups. The token budget (6 x requests)
  lets about all of them run; the table shows the batch and the prefill tokens per
  iteration, which the mixed cost grows with.

Timings are per iteration, median (and p90) of ``--iters`` iterations after a warm-up that
brings the system to its steady state; the table also shows the average batch.

By default each iteration is ``schedule()`` then ``update()`` of that plan, as with
``--no-overlap``. ``--overlap`` drives the scheduler as the server does by default: the plan
for step N+1 is formed while step N is in flight, then N is applied; an iteration is then one
``update()`` plus the ``schedule()`` calls made since the last one. Planning ahead takes
paths the default loop never does (pending tokens, accounting for the plan in flight), so it
is the fairer picture of a server's cost; the default loop is kept as the reference.

    python bench/scheduler.py                    # all scenarios and sizes
    python bench/scheduler.py --sizes 256 --scenarios decode --iters 2000
    python bench/scheduler.py --sizes 256 --scenarios mixed --overlap
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections import deque

import numpy as np

from conveyor.ipc.messages import AddRequest, SamplingParams, StepPlan, StepResult, int_list
from conveyor.runtime.config import SchedulerConfig
from conveyor.scheduler.scheduler import Scheduler

BLOCK_SIZE = 16
SYSTEM_PROMPT = [7 + (i * 13) % 900 for i in range(512)]


class SamplingStub:
    """Samples token 11 for every request whose known tokens are all computed after the step."""

    def __init__(self) -> None:
        self.known: dict[int, int] = {}  # slot -> tokens known

    def execute(self, plan: StepPlan) -> StepResult:
        for slot in int_list(plan.finished_slots):
            self.known.pop(slot, None)
        slots: list[int] = []
        for new in plan.new_requests:
            self.known[new.slot] = len(new.token_ids)
            if new.num_computed_tokens + new.num_scheduled_tokens == len(new.token_ids):
                slots.append(new.slot)
        cached = plan.cached_requests
        known = self.known
        for slot, computed, n in zip(
            int_list(cached.slots), int_list(cached.num_computed_tokens), int_list(cached.num_scheduled_tokens)
        ):
            if computed + n == known[slot]:
                slots.append(slot)
        for slot in slots:
            known[slot] += 1
        # int32 arrays, as the scheduler process hands a decoded result to update().
        return StepResult(plan.step_id, np.array(slots, np.int32), np.full(len(slots), 11, np.int32))


class Load:
    """Keeps ``n`` requests in the system, replacing each finished one (mixed) or none (decode)."""

    def __init__(self, scenario: str, n: int, seed: int = 0) -> None:
        self.scenario = scenario
        self.n = n
        self.rng = random.Random(seed)
        self.count = 0
        # Mixed: room for every decode plus the prefill that keeps ~n requests running.
        budget = max(2048, n + 512) if scenario == "decode" else max(2048, 6 * n)
        self.config = SchedulerConfig(
            num_blocks=n * (4096 // BLOCK_SIZE + 2) if scenario == "decode" else n * 96 + 64,
            block_size=BLOCK_SIZE,
            max_num_seqs=n,
            max_num_batched_tokens=budget,
            max_model_len=8192,
            max_waiting=0,
            max_queue_time=0,
        )
        self.scheduler = Scheduler(self.config, eos_token_ids=[0], vocab_size=None)

    def request(self) -> AddRequest:
        rng = self.rng
        self.count += 1
        rid = f"req-{self.count}"
        if self.scenario == "decode":
            prompt = [1 + (self.count * 31 + i) % 900 for i in range(128)]
            max_tokens = 8000
        else:
            length = rng.randint(64, 1024)
            unique = [1 + rng.randrange(900) for _ in range(length)]
            prompt = (SYSTEM_PROMPT + unique[:512]) if rng.random() < 0.5 else unique
            max_tokens = rng.randint(16, 256)
        return AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), time.time())

    def fill(self) -> None:
        sched = self.scheduler
        while len(sched.state.table.live) < self.n:
            assert sched.add_request(self.request()) is None


def measure(scenario: str, n: int, iters: int, overlap: bool = False) -> dict[str, float]:
    load = Load(scenario, n)
    sched = load.scheduler
    worker = SamplingStub()
    load.fill()
    warmup = 60 + (n * 128) // 2048 if scenario == "decode" else 400
    times: list[float] = []
    batch = prefill = 0
    inflight: deque[StepPlan] = deque()
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        if not inflight:
            inflight.append(sched.schedule())
        if overlap and sched.can_plan_ahead:
            ahead = sched.schedule()  # step N+1, planned while N is in flight
            if ahead is not None:
                inflight.append(ahead)
        t1 = time.perf_counter()
        plan = inflight.popleft()
        result = worker.execute(plan)
        t2 = time.perf_counter()
        sched.update(plan, result)
        t3 = time.perf_counter()
        if scenario == "mixed":
            load.fill()
        if i >= warmup:
            times.append((t1 - t0) + (t3 - t2))
            row = sched.iterations.last()
            batch += row["batch_size"]
            prefill += row["prefill_tokens"]
    times.sort()
    return {
        "median_us": statistics.median(times) * 1e6,
        "p90_us": times[int(0.9 * len(times))] * 1e6,
        "batch": batch / iters,
        "prefill": prefill / iters,
        "running": sched.num_running,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,256,1024")
    p.add_argument("--scenarios", default="decode,mixed")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; the table shows the fastest median")
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="plan step N+1 before applying step N, as the server does by default",
    )
    args = p.parse_args(argv)
    print(
        f"python {sys.version.split()[0]}, gc {'on' if gc.isenabled() else 'off'}, block size {BLOCK_SIZE}, "
        f"overlap {'on' if args.overlap else 'off'}"
    )
    print(f"{'scenario':<8} {'requests':>8} {'median us':>10} {'p90 us':>8} {'avg batch':>10} {'prefill tok':>12}")
    for scenario in args.scenarios.split(","):
        for n in (int(s) for s in args.sizes.split(",")):
            runs = [measure(scenario, n, args.iters, args.overlap) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["median_us"])
            print(
                f"{scenario:<8} {n:>8} {best['median_us']:>10.1f} {best['p90_us']:>8.1f} "
                f"{best['batch']:>10.1f} {best['prefill']:>12.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
