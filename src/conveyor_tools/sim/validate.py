"""conveyor-sim beside bin/bench (issue 30): one command measures, calibrates, simulates, tabulates.

    python3 bench/sim_validate.py run --out bench/results/sim-validation-cpu/
    python3 bench/sim_validate.py evaluate bench/results/sim-validation-cpu/   # refit, resimulate

``run``: for each batch size (8, 16, 32) two calibration runs (``uniform`` and ``lognormal``
without spread: varied lengths and equal ones, workloads none of the validated ones is) and
then the three validated workloads (``fixed``, ``sharegpt``,
``high-variance``), each a ``bin/bench offline`` of the demo model on a profiling server, one
torch thread. The runs are interleaved by batch size, so a drift of the machine's load
touches calibration and validation alike. Then ``evaluate``: the cost model fitted to the
calibration runs' step records only (``cost.json``), each validated run replayed in the
simulator (its workload rebuilt from the run's own record and checked to be the same
requests; the run's batch size, token budget and KV pool) and a table of measured beside
simulated output throughput and p50/p99 TTFT, the relative error and a pass per cell
(|error| <= tolerance): ``validation.md`` and ``validation.json``, with the load average
around every run.

Two diagnostics per row split an error into its causes: ``cost_error``, the cost model's
total over the run's *measured* step shapes against their measured busy time (the cost
model alone, whatever the scheduling), and the measured and simulated step counts (the
scheduling replayed: equal when the simulator forms the server's plans).

What each side counts: bin/bench's throughput is output tokens over the client's wall time
(first request sent to last result back); its TTFT is the frontend's, from a request's
arrival there to its first token there. The simulation's requests arrive at the scheduler
(the first alone, the rest a millisecond later, as the server takes them in: :func:`replay`)
and each ends at the step that produced its last token. The difference is the transport both
ways: milliseconds, against runs of seconds (the worker's step records tile a run's wall time
to within 15 to 85 ms on this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.runtime.config import SchedulerConfig
from conveyor_tools.bench.workloads import make_workload
from conveyor_tools.cli.sim import calibrate, find_step_records
from conveyor_tools.sim.cost import CostModel, StepCost, records_arrays
from conveyor_tools.sim.simulator import SimRequest, simulate

# Calibration: varied lengths (uniform) and equal ones (lognormal with no spread: every
# request 128 + 48 tokens), so the fit sees full batches of one length class and of many.
CALIBRATION = ("uniform", "lognormal")
# bin/bench flags of each workload: short enough that the whole run fits 10 minutes on 2 cores.
WORKLOAD_ARGS: dict[str, list[str]] = {
    "uniform": ["--min-len", "16", "--max-len", "256"],
    "lognormal": ["--prompt-len", "128", "--output-len", "48", "--output-sigma", "0"],
    "fixed": ["--prompt-len", "64", "--output-len", "64"],
    "sharegpt": ["--scale", "0.25"],
    "high-variance": [],
}
VALIDATED = ("fixed", "sharegpt", "high-variance")
METRICS = (("output_tok_s", "out tok/s"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p99_s", "TTFT p99 s"))
# make_workload's length parameters, as a run's record names them.
WORKLOAD_PARAMS = ("prompt_len", "output_len", "min_len", "max_len", "scale", "output_sigma")
RUN_TIMEOUT_S = 600
INTAKE_S = 1e-3  # when the rest of an offline run's requests reach the scheduler, after the first

Measure = Callable[[list[str], Path], None]


def bench_command(workload: str, batch: int, num_requests: int, threads: int, json_path: Path) -> list[str]:
    """The ``bin/bench offline`` command of one run (conveyor only, demo model)."""
    return [
        sys.executable, "-m", "conveyor_tools.cli.bench", "offline", "--systems", "conveyor", "--workload", workload,
        *WORKLOAD_ARGS[workload], "--num-requests", str(num_requests), "--batch-size", str(batch),
        "--threads", str(threads), "--no-progress", "--json", str(json_path),
    ]  # fmt: skip


def measure(command: list[str], json_path: Path) -> None:
    """Run one bin/bench command, its output to a log beside its JSON; a failed run stops
    the validation (a table with a hole would read as a result), saying where its log is."""
    log_path = json_path.with_suffix(".log")
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=RUN_TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise SystemExit(f"sim_validate: {' '.join(command)}\nfailed ({exc}); {log_path} ends:\n{tail}") from exc


def run_name(workload: str, batch: int) -> str:
    return f"{workload}-b{batch}"


def measure_all(out: Path, batches: list[int], num_requests: int, calibration_requests: int, threads: int,
                measure: Measure = measure) -> None:  # fmt: skip
    """Every run, interleaved by batch size, each run's JSON under ``out``; prints progress.
    The load average (1 min, the higher of before and after) of each run goes to loads.json."""
    plan = [(w, b) for b in batches for w in (*CALIBRATION, *VALIDATED)]
    start = time.perf_counter()
    loads: dict[str, float] = {}
    for i, (workload, batch) in enumerate(plan, 1):
        name = run_name(workload, batch)
        path = out / f"{name}.json"
        n = calibration_requests if workload in CALIBRATION else num_requests
        before = os.getloadavg()[0]
        t0 = time.perf_counter()
        measure(bench_command(workload, batch, n, threads, path), path)
        loads[name] = max(before, os.getloadavg()[0])
        (out / "loads.json").write_text(json.dumps(loads, indent=1) + "\n")
        m = measured_metrics(json.loads(path.read_text()))
        took, total = time.perf_counter() - t0, time.perf_counter() - start
        print(f"[{i}/{len(plan)}] {name}: {m['output_tok_s']:.0f} out tok/s, TTFT p50 {m['ttft_p50_s']:.2f} s "
              f"({took:.0f} s; {total:.0f} s in all; load {loads[name]:.1f})", flush=True)  # fmt: skip


# ---------------------------------------------------------------------- evaluate


def replay(run: dict[str, Any], model: CostModel) -> dict[str, Any]:
    """Simulate a bin/bench offline run of conveyor: its requests (rebuilt, and checked to be
    the ones it sent), on the scheduler configuration its server had. The first request
    arrives at t = 0 and the rest :data:`INTAKE_S` later: the server plans as soon as the
    first one reaches it, so its first step holds that one alone, and in a workload of equal
    lengths that one stays a step ahead of its wave for the whole run."""
    wl, settings = run["workload"], run["settings"]
    workload = make_workload(
        wl["name"], wl["num_requests"], seed=wl["seed"], vocab_size=settings["model_config"]["vocab_size"],
        max_model_len=settings["max_model_len"], **{k: v for k, v in wl["params"].items() if k in WORKLOAD_PARAMS},
    )  # fmt: skip
    rebuilt = workload.describe()
    counts = ("prompt_tokens", "output_tokens", "num_clamped")  # integers (the JSON rounds the means)
    if any(rebuilt[k] != wl[k] for k in counts) or any(
        rebuilt[k][m] != wl[k][m] for k in ("prompt_len", "output_len") for m in ("min", "max")
    ):
        raise ValueError(f"the {wl['name']} workload rebuilt from the run's record is not the run's: {rebuilt} vs {wl}")
    records = run["systems"]["conveyor"]["extra"]["step_records"]
    cost = model.step(1)
    config = SchedulerConfig(
        num_blocks=records["num_blocks"] or cost.num_blocks,
        max_num_seqs=settings["batch_size"],
        max_num_batched_tokens=settings["max_batched_tokens"],
        max_model_len=settings["max_model_len"],
    )
    reqs = [
        SimRequest(INTAKE_S if i else 0.0, r.prompt_ids, r.output_len, str(i)) for i, r in enumerate(workload.requests)
    ]
    sim = simulate(reqs, config, cost, sync_overhead_s=model.sync_overhead_s).summary()
    return {
        "simulated": {
            "output_tok_s": sim["output_tok_s"],
            "ttft_p50_s": sim["ttft_s"]["p50"],
            "ttft_p99_s": sim["ttft_s"]["p99"],
        },
        "cost_error": cost_error(records, cost),
        "steps": {"measured": len(records["step_time"]), "simulated": sim["num_steps"]},
    }


def cost_error(records: dict[str, Any], cost: StepCost) -> float | None:
    """The cost model's total over recorded steps against their measured total, minus 1."""
    features, times = records_arrays(records)
    predicted = sum(cost.time(f[:-2], f[-2]) for f in features)
    return predicted / times.sum() - 1 if times.sum() > 0 else None


def measured_metrics(run: dict[str, Any]) -> dict[str, float]:
    summary = run["systems"]["conveyor"]["runs"][0]
    return {
        "output_tok_s": summary["output_tok_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
    }


def evaluate(out: Path, batches: list[int], tolerance: float) -> dict[str, Any]:
    """Fit on the calibration runs in ``out``, replay the validated ones, write the table."""
    loads_path = out / "loads.json"
    loads = json.loads(loads_path.read_text()) if loads_path.exists() else {}
    calibration = [(w, b) for b in batches for w in CALIBRATION]
    cal_paths = [str(out / f"{run_name(w, b)}.json") for w, b in calibration]
    model = calibrate(cal_paths, 1, str(out / "cost.json"), None)
    rows = []
    for batch in batches:
        for workload in VALIDATED:
            name = run_name(workload, batch)
            run = json.loads((out / f"{name}.json").read_text())
            if not find_step_records(run):
                raise ValueError(f"{name}: no step records (a profiling server writes them)")
            row = {"workload": workload, "batch": batch, "measured": measured_metrics(run), **replay(run, model)}
            row["error"] = {k: row["simulated"][k] / row["measured"][k] - 1 for k, _ in METRICS}
            row["pass"] = {k: abs(e) <= tolerance for k, e in row["error"].items()}
            row["load"] = loads.get(name)
            rows.append(row)
    cost = model.step(1)
    result = {
        "tolerance": tolerance,
        "cost_model": cost.to_json(),
        "calibration_runs": cal_paths,
        # In sample: how far each calibration run's own level is from the pooled fit's (load drift).
        "calibration": [
            {
                "workload": w,
                "batch": b,
                "load": loads.get(run_name(w, b)),
                "cost_error": cost_error(find_step_records(json.loads(Path(path).read_text()))[0], cost),
            }
            for (w, b), path in zip(calibration, cal_paths)
        ],  # fmt: skip
        "rows": rows,
        "cells": len(rows) * len(METRICS),
        "cells_passed": sum(sum(r["pass"].values()) for r in rows),
        "worst_error": max(abs(e) for r in rows for e in r["error"].values()),
    }
    (out / "validation.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "validation.md").write_text(markdown(result) + "\n")
    return result


def markdown(result: dict[str, Any]) -> str:
    metrics = "".join(f" {label} measured | simulated | error |" for _, label in METRICS)
    head = f"| workload | batch |{metrics} cost model | steps meas./sim. | load |"
    lines = [head, "|---|---:|" + "---:|---:|---:|" * len(METRICS) + "---:|---:|---:|"]
    for r in result["rows"]:
        cells = [r["workload"], str(r["batch"])]
        for key, _ in METRICS:
            mark = "" if r["pass"][key] else " **x**"
            cells += [f"{r['measured'][key]:.2f}", f"{r['simulated'][key]:.2f}", f"{r['error'][key]:+.0%}{mark}"]
        cost_error = "-" if r["cost_error"] is None else f"{r['cost_error']:+.0%}"
        load = "-" if r["load"] is None else f"{r['load']:.1f}"
        cells += [cost_error, f"{r['steps']['measured']}/{r['steps']['simulated']}", load]
        lines.append("| " + " | ".join(cells) + " |")
    c = result["cost_model"]
    coefs = ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in c["coef_s"].items())
    lines += [
        "",
        f"{result['cells_passed']} of {result['cells']} cells within {result['tolerance']:.0%} (**x**: outside); "
        f"worst error {result['worst_error']:.0%}.",
        f"Cost model (calibration runs only, {c['num_steps']} steps, {c['num_trimmed']} left out as outliers): "
        f"intercept {c['intercept_s'] * 1e3:.3f} ms, {coefs}; residual {c['rel_rmse']:.0%} of the mean step.",
        "Calibration runs, the fit's total over each one's own steps (in sample; a spread is load drift): "
        + ", ".join(f"{c['workload']} batch {c['batch']} {c['cost_error']:+.0%}" for c in result["calibration"])
        + ".",
        "cost model: its total over the run's measured step shapes against their measured time; "
        "load: the 1-minute load average, the higher of before and after the run.",
    ]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None, measure: Measure = measure) -> int:
    p = argparse.ArgumentParser(prog="sim_validate", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--batch-sizes", type=_ints, default=[8, 16, 32])
    common.add_argument("--tolerance", type=float, default=0.15, help="a cell passes within this relative error")
    run = sub.add_parser("run", parents=[common], help="measure, calibrate, simulate, tabulate")
    run.add_argument("--out", type=Path, required=True, help="directory for the runs, cost.json, validation.md/json")
    run.add_argument("--num-requests", type=int, default=64, help="requests of each validated run")
    run.add_argument("--calibration-requests", type=int, default=32, help="requests of each calibration run")
    run.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ev = sub.add_parser("evaluate", parents=[common], help="refit and resimulate the runs already in a directory")
    ev.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if args.mode == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        runs = len(args.batch_sizes) * (len(CALIBRATION) + len(VALIDATED))
        print(f"sim_validate: {runs} bin/bench runs into {args.out} (about 5 minutes on a quiet 2-core machine, "
              f"20 or more at load 10; load now {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
        measure_all(args.out, args.batch_sizes, args.num_requests, args.calibration_requests, args.threads, measure)
    result = evaluate(args.out, args.batch_sizes, args.tolerance)
    print((args.out / "validation.md").read_text(), end="")
    return 0 if result["cells_passed"] == result["cells"] else 1
