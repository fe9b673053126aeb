#!/usr/bin/env python3
"""Plan round trip scheduler -> worker -> scheduler with an empty forward (a script, not a test).

This process plays the scheduler: it sends a decode-step :class:`StepPlan` naming ``N``
running requests (by slot, ``0 .. N - 1``, as the scheduler does) on the real step channel
(:mod:`conveyor.ipc.step_channel`) and waits for the :class:`StepResult`. A ``spawn``ed
stand-in worker does what the worker process does around the model: receive and decode the
plan, read its columns into Python ints (as the model runner does), build a result with
one sampled token per request and send it. The time from before ``send`` (encoding
included) to the decoded result with its tokens read out is one round trip: everything
the hop costs a step apart from the forward itself. Both transports, same messages:

- ``shm``: a shared-memory ring each way (the default of bin/serve);
- ``zmq``: ZeroMQ PUSH/PULL over ``ipc://`` (``--plan-transport zmq``).

The scheduler side waits the way scheduler/main.py does (spin, then the doorbell in a
poller); the stand-in worker blocks in ``recv`` as worker/main.py does. Runs of the two
transports are interleaved (``--rounds``) so that load from elsewhere on the machine hits
both alike; p50/p99 are over all rounds.

    python bench/plan_roundtrip.py                          # N = 1, 64, 256; both transports
    python bench/plan_roundtrip.py --sizes 256 --iters 20000 --json out.json
    python bench/plan_roundtrip.py --spin-us 5000       # both ends spin instead of sleeping
    python bench/plan_roundtrip.py --in-process         # both ends in one process: CPU cost only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import zmq
from harness import write_report  # bench/ is this script's directory

from conveyor.ipc import step_channel
from conveyor.ipc.messages import CachedRequests, Shutdown, StepPlan, StepResult
from conveyor.ipc.step_channel import StepChannels, StepSender
from conveyor.ipc.step_receivers import StepReceiver
from conveyor.runtime.config import PlanTransport
from conveyor_tools.stand_in_worker import answer_plans


def answer(plan: StepPlan) -> StepResult:
    """The stand-in worker's part of a step: read the plan's columns into Python ints (as the
    model runner does) and sample token 11 for every request."""
    cached = plan.cached_requests
    slots = cached.slots.tolist()
    computed = cached.num_computed_tokens.tolist()
    cached.num_scheduled_tokens.tolist()
    return StepResult(plan.step_id, slots, np.full(len(computed), 11, dtype=np.int32))


def decode_plan(step: int, slots: list[int]) -> StepPlan:
    n = len(slots)
    return StepPlan(step, [], CachedRequests(slots, np.arange(100, 100 + n, dtype=np.int32), np.ones(n, np.int32)), [])


@contextlib.contextmanager
def server_channels(transport: str, spin_us: float | None = None) -> Iterator[StepChannels]:
    """The step channels bin/serve would make (rings created), removed again on exit."""
    run_dir = tempfile.mkdtemp(prefix="cv-rt-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    channels = StepChannels.for_server(
        run_dir, f"ipc://{run_dir}/plans", f"ipc://{run_dir}/results", shm=transport == "shm"
    )
    if spin_us is not None:
        channels = StepChannels(
            dataclasses.replace(channels.plans, spin_us=spin_us), dataclasses.replace(channels.results, spin_us=spin_us)
        )
    step_channel.create_rings(channels)
    try:
        yield channels
    finally:
        step_channel.remove_rings(channels)
        os.rmdir(run_dir) if not os.listdir(run_dir) else None


def time_round_trips(n: int, iters: int, warmup: int, hop: Callable[[StepPlan], StepResult]) -> list[int]:
    """ns per ``hop`` (plan sent, result back and decoded) of decode plans of ``n`` requests,
    the result's columns read out as scheduler/main.py does; the first ``warmup`` not kept."""
    slots = list(range(n))
    samples: list[int] = []
    for step in range(warmup + iters):
        plan = decode_plan(step, slots)
        start = time.perf_counter_ns()
        result = hop(plan)
        result.slots.tolist()
        tokens = result.sampled_token_ids.tolist()
        end = time.perf_counter_ns()
        assert result.step_id == step and len(tokens) == n
        if step >= warmup:
            samples.append(end - start)
    return samples


def run(transport: str, n: int, iters: int, warmup: int, spin_us: float | None) -> list[int]:
    with server_channels(transport, spin_us) as channels:
        ctx = zmq.Context()
        plans = StepSender(ctx, channels.plans, bind=True)
        results = StepReceiver(ctx, channels.results, bind=True)
        poller = zmq.Poller()
        poller.register(results.pollable(), zmq.POLLIN)
        worker = mp.get_context("spawn").Process(target=answer_plans, args=(channels, answer), daemon=True)
        worker.start()

        def hop(plan: StepPlan) -> StepResult:
            plans.send(plan)
            while not (results.spin() or results.arm()):  # as the scheduler loop waits
                poller.poll(100)
                results.disarm()
            results.disarm()
            return results.recv(0)

        try:
            samples = time_round_trips(n, iters, warmup, hop)
            plans.send(Shutdown("done"))
            worker.join(10)
        finally:
            if worker.is_alive():
                worker.kill()
            plans.close()
            results.close()
            ctx.term()
    return samples


def run_in_process(transport: str, n: int, iters: int, warmup: int) -> list[int]:
    """The same round trip with both ends in this process (``--in-process``): every encode,
    ring or socket operation and decode of the two hops, and no process wake-up at all;
    what the hop costs in CPU, the floor of the two-process figure."""
    with server_channels(transport) as channels:
        ctx = zmq.Context()
        ends = (
            StepSender(ctx, channels.plans, bind=True),
            StepReceiver(ctx, channels.results, bind=True),
            StepReceiver(ctx, channels.plans, bind=False),
            StepSender(ctx, channels.results, bind=False),
        )
        plans_tx, results_rx, plans_rx, results_tx = ends

        def hop(plan: StepPlan) -> StepResult:
            plans_tx.send(plan)
            results_tx.send(answer(plans_rx.recv()))
            return results_rx.recv()

        try:
            samples = time_round_trips(n, iters, warmup, hop)
        finally:
            for end_ in ends:
                end_.close()
            ctx.term()
    return samples


def summary(samples_ns: list[int]) -> dict[str, float]:
    a = np.array(samples_ns) / 1e3
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p90_us": float(np.percentile(a, 90)),
        "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
        "count": int(a.size),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256], help="requests per plan")
    p.add_argument("--transports", nargs="+", default=["shm", "zmq"], choices=PlanTransport.names())
    p.add_argument("--iters", type=int, default=5000, help="round trips per size and transport (over all rounds)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved runs per size and transport")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--spin-us", type=float, help="ring readers' spin before sleeping (default: bin/serve's)")
    p.add_argument("--in-process", action="store_true", help="both ends in this process: the hop's CPU cost alone")
    p.add_argument("--json", help="write raw percentiles and machine info here")
    args = p.parse_args()

    report = {
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "load_avg": os.getloadavg(),
        },
        "args": vars(args),
        "results": [],
    }
    print(f"{'requests':>8} {'transport':>9} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'mean us':>8}")
    for n in args.sizes:
        samples: dict[str, list[int]] = {t: [] for t in args.transports}
        for _ in range(args.rounds):
            for t in args.transports:
                if args.in_process:
                    samples[t] += run_in_process(t, n, args.iters // args.rounds, args.warmup)
                else:
                    samples[t] += run(t, n, args.iters // args.rounds, args.warmup, args.spin_us)
        for t in args.transports:
            s = summary(samples[t])
            report["results"].append({"requests": n, "transport": t, **s})
            print(f"{n:>8} {t:>9} {s['p50_us']:>8.1f} {s['p90_us']:>8.1f} {s['p99_us']:>8.1f} {s['mean_us']:>8.1f}")
    report["machine"]["load_avg_after"] = os.getloadavg()
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
