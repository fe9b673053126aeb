#!/usr/bin/env python3
"""Simulated beside measured: replays each bin/bench offline run's workload in conveyor-sim.

    python3 bench/sim_validate.py --cost cost.json run1.json run2.json ...

For every ``bin/bench offline --json`` file (system conveyor) it rebuilds the workload from
the file (name, seed, parameters, vocabulary), simulates it with the run's batch size and
token budget on the KV pool the run's server had, and prints a markdown table of measured
and simulated output throughput and p50/p99 TTFT with the relative error: the validation
table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math

from conveyor.profiling import plan_shape
from conveyor.runtime.config import SchedulerConfig
from conveyor_tools.bench.workloads import make_workload
from conveyor_tools.sim.cost import CostModel
from conveyor_tools.sim.simulator import SimRequest, simulate

PARAMS = {"fixed": ("prompt_len", "output_len"), "uniform": ("min_len", "max_len"), "sharegpt": ("scale",)}


def replay(run: dict, model: CostModel) -> tuple[dict, dict]:
    wl, settings = run["workload"], run["settings"]
    kwargs = {k: wl["params"][k] for k in PARAMS.get(wl["name"], ())}
    workload = make_workload(
        wl["name"], wl["num_requests"], seed=wl["seed"], vocab_size=settings["model_config"]["vocab_size"],
        max_model_len=settings["max_model_len"], **kwargs,
    )  # fmt: skip
    system = run["systems"]["conveyor"]
    cost = model.step(1)
    config = SchedulerConfig(
        num_blocks=system["extra"]["step_records"]["num_blocks"] or cost.num_blocks,
        max_num_seqs=settings["batch_size"],
        max_num_batched_tokens=settings["max_batched_tokens"],
        max_model_len=settings["max_model_len"],
    )
    reqs = [SimRequest(0.0, r.prompt_ids, r.output_len, str(i)) for i, r in enumerate(workload.requests)]
    sim = simulate(reqs, config, lambda p: cost.time(plan_shape(p)), sync_overhead_s=model.sync_overhead_s).summary()
    return system["runs"][0], sim


def err(sim: float, measured: float) -> str:
    return f"{(sim - measured) / measured:+.0%}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost", required=True)
    p.add_argument("runs", nargs="+")
    args = p.parse_args()
    model = CostModel.load(args.cost)
    print("| workload | batch | out tok/s measured | simulated | error | TTFT p50 s measured | simulated | error "
          "| TTFT p99 s measured | simulated | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for path in args.runs:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        meas, sim = replay(run, model)
        cells = [run["workload"]["name"], str(run["settings"]["batch_size"])]
        for m, s in ((meas["output_tok_s"], sim["output_tok_s"]), (meas["ttft_s"]["p50"], sim["ttft_s"]["p50"]),
                     (meas["ttft_s"]["p99"], sim["ttft_s"]["p99"])):  # fmt: skip
            cells += [f"{m:.2f}", f"{s:.2f}", err(s, m)]
            worst = max(worst, abs(s - m) / m)
        print("| " + " | ".join(cells) + " |")
    print(f"\nworst error {worst:.0%}")
    return 0 if math.isfinite(worst) else 1


if __name__ == "__main__":
    raise SystemExit(main())
