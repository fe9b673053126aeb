"""bin/sim: predict what a deployment does before running it, with the real scheduler.

    bin/sim calibrate bench.json --out cost.json                 # fit step costs to a bin/bench run
    bin/sim run --cost cost.json --workload sharegpt --num-requests 200 --rate 4 --batch-size 32
    bin/sim run --cost cost.json --trace arrivals.csv --dp 2     # a trace: arrival,prompt_len,output_len
    bin/sim sweep --cost cost.json --workload sharegpt --rate 20 --slo-ttft-ms 500 --slo-tpot-ms 50 \\
        --tp 1,2,4 --dp 1,2,4,8 --max-num-seqs 32,64,128

``calibrate`` reads the per-step records (plan shape, busy time) the worker keeps under
--profile, which ``bin/bench offline`` saves in its JSON (``extra.step_records``), and fits
the linear cost model of :mod:`conveyor_tools.sim.cost` (non-negative, outliers left out);
``--tp`` says which tensor-parallel size the run had (a file holds one model per size;
calibrating another size adds it). ``run`` replays a workload (bin/bench's, same seeds) or a trace through the real
scheduler in virtual time (:mod:`conveyor_tools.sim.simulator`). ``sweep`` tries
data-parallel replicas x tensor-parallel sizes x batch knobs at a target rate and prints the
cheapest configuration (fewest GPUs) whose p99 TTFT and TPOT meet the bounds. The product
never imports this tool.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.profiling import STEP_SERIES
from conveyor.runtime.config import SchedulerConfig
from conveyor_tools.bench.workloads import WORKLOADS, poisson_arrivals, workload_from_args
from conveyor_tools.sim.cost import CostModel, fit, records_arrays
from conveyor_tools.sim.simulator import SimRequest, simulate

DEMO_VOCAB = 4096  # the demo model's (bin/serve --model demo), as bin/bench uses it by default
DEMO_MAX_MODEL_LEN = 2048


# ---------------------------------------------------------------------- calibrate


def find_step_records(data: Any) -> list[dict[str, Any]]:
    """Every ``step_records`` map (columns :data:`conveyor.profiling.STEP_SERIES`) in a
    bin/bench JSON, wherever the run put it."""
    found = []
    if isinstance(data, dict):
        if isinstance(data.get("step_records"), dict) and all(k in data["step_records"] for k in STEP_SERIES):
            found.append(data["step_records"])
        for value in data.values():
            found.extend(find_step_records(value))
    elif isinstance(data, list):
        for value in data:
            found.extend(find_step_records(value))
    return found


def calibrate(
    paths: list[str], tp: int, out: str, sync_overhead_s: float | None, experts: tuple[int, int] | None = None
) -> CostModel:
    shapes, times, blocks = [], [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for rec in find_step_records(json.load(f)):
                s, t = records_arrays(rec, experts)
                shapes.append(s)
                times.append(t)
                if rec.get("num_blocks"):
                    blocks.append(int(rec["num_blocks"]))
    if not shapes or sum(len(t) for t in times) == 0:
        raise SystemExit(
            f"calibrate: no step records with every series of {', '.join(STEP_SERIES)} in {', '.join(paths)} "
            "(bin/bench offline with a profiling server writes them; a run of an older tree lacks the newer series)"
        )
    runs = np.concatenate([np.full(len(t), k) for k, t in enumerate(times)])
    cost = fit(np.concatenate(shapes), np.concatenate(times), source=", ".join(paths), runs=runs, experts=experts)
    cost.num_blocks = min(blocks) if blocks else None
    model = CostModel.load(out) if Path(out).exists() else CostModel({})
    model.by_tp[tp] = cost
    if sync_overhead_s is not None:
        model.sync_overhead_s = sync_overhead_s
    model.save(out)
    return model


def _experts(text: str) -> tuple[int, int]:
    """``E:K`` -> ``(E, K)``, 1 <= K <= E."""
    try:
        num, top_k = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--experts wants E:K (e.g. 128:8), got {text!r}") from None
    if not 1 <= top_k <= num:
        raise argparse.ArgumentTypeError(f"--experts {text}: K must be between 1 and E")
    return num, top_k


# ---------------------------------------------------------------------- requests


def load_trace(path: str, seed: int, vocab_size: int) -> list[SimRequest]:
    """A CSV trace with a header naming ``arrival`` (s), ``prompt_len`` and ``output_len``;
    prompt token ids are drawn from ``seed`` (only their count matters without shared prefixes)."""
    rng = np.random.default_rng(seed)
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            ids = rng.integers(10, vocab_size, int(row["prompt_len"])).tolist()
            out.append(SimRequest(float(row["arrival"]), ids, int(row["output_len"]), str(i)))
    return out


def workload_requests(args: argparse.Namespace, rate: float) -> list[SimRequest]:
    """bin/bench's workload (same generator, same seed) arriving at ``rate`` (Poisson, same
    seed as bin/bench online; inf: all at once, as bin/bench offline), or the trace."""
    if args.trace:
        return load_trace(args.trace, args.seed, args.vocab_size)
    wl = workload_from_args(args, vocab_size=args.vocab_size, max_model_len=args.max_model_len)
    arrivals = poisson_arrivals(len(wl.requests), rate, args.seed)
    return [SimRequest(t, r.prompt_ids, r.output_len, str(i)) for i, (t, r) in enumerate(zip(arrivals, wl.requests))]


def scheduler_config(
    args: argparse.Namespace, model: CostModel, tp: int, max_num_seqs: int, max_batched: int
) -> SchedulerConfig:
    num_blocks = args.num_blocks or model.step(tp).num_blocks
    if not num_blocks:
        raise SystemExit(f"sim: the KV pool size is unknown for tp {tp}: pass --num-blocks")
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=args.max_model_len,
        preemption=args.preemption,
    )


def run_once(args: argparse.Namespace, model: CostModel, requests: list[SimRequest], tp: int, dp: int,
             max_num_seqs: int, max_batched: int) -> dict[str, Any]:  # fmt: skip
    config = scheduler_config(args, model, tp, max_num_seqs, max_batched)
    cost = model.step(tp)
    result = simulate(
        requests, config, cost, replicas=dp, overlap=not args.no_overlap,
        sync_overhead_s=model.sync_overhead_s,
    )  # fmt: skip
    return {"tp": tp, "dp": dp, "gpus": tp * dp, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched,
            "num_blocks": config.num_blocks, **result.summary()}  # fmt: skip


# ---------------------------------------------------------------------- sweep


def meets(summary: dict[str, Any], slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """Every request served, p99 TTFT and p99 TPOT within the bounds."""
    if summary["num_failed"]:
        return False
    ttft, tpot = summary["ttft_s"]["p99"], summary["tpot_s"]["p99"]
    return ttft is not None and ttft <= slo_ttft_s and (tpot is None or tpot <= slo_tpot_s)


def sweep(args: argparse.Namespace, model: CostModel, requests: list[SimRequest], tps: list[int], dps: list[int],
          seqs: list[int], batched: list[int], slo_ttft_s: float, slo_tpot_s: float) -> tuple[list[dict],
                                                                                              dict | None]:  # fmt: skip
    """Every configuration in order of GPUs (tp x dp), stopping after the first GPU count at
    which one meets the target: the rows tried, and the cheapest that met it (among those
    with as few GPUs, the lowest p99 TTFT), or None."""
    grid = sorted(itertools.product(tps, dps, seqs, batched), key=lambda c: (c[0] * c[1], c))
    rows, best = [], None
    for gpus, group in itertools.groupby(grid, key=lambda c: c[0] * c[1]):
        if best is not None:
            break
        for tp, dp, n, b in group:
            row = run_once(args, model, requests, tp, dp, n, b)
            row["meets"] = meets(row, slo_ttft_s, slo_tpot_s)
            rows.append(row)
            if row["meets"] and (best is None or row["ttft_s"]["p99"] < best["ttft_s"]["p99"]):
                best = row
    return rows, best


# ---------------------------------------------------------------------- output


def _ms(v: float | None) -> str:
    return f"{v * 1e3:9.1f}" if v is not None else f"{'-':>9}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'tp':>3} {'dp':>3} {'gpus':>4} {'seqs':>5} {'tokens':>6} {'req/s':>7} {'out tok/s':>9} "
            f"{'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9} {'queue p99':>9} {'preempt':>7} "
            f"{'occ':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "" if "meets" not in r else ("  meets" if r["meets"] else "")
        occ = r["mean_batch_seqs"]
        lines.append(
            f"{r['tp']:>3} {r['dp']:>3} {r['gpus']:>4} {r['max_num_seqs']:>5} {r['max_num_batched_tokens']:>6} "
            f"{r['req_s']:>7.2f} {r['output_tok_s']:>9.1f} {_ms(r['ttft_s']['p50'])} {_ms(r['ttft_s']['p99'])} "
            f"{_ms(r['tpot_s']['p50'])} {_ms(r['tpot_s']['p99'])} {_ms(r['queueing_s']['p99'])} "
            f"{r['num_preemptions']:>7} {occ if occ is not None else 0:>5.1f}{mark}"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    work = argparse.ArgumentParser(add_help=False)
    work.add_argument("--cost", required=True, help="cost model JSON (conveyor-sim calibrate)")
    work.add_argument("--workload", default="high-variance", choices=WORKLOADS)
    work.add_argument("--trace", help="CSV of arrival,prompt_len,output_len instead of a workload")
    work.add_argument("--num-requests", type=int, default=64)
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--prompt-len", type=int, default=128)
    work.add_argument("--output-len", type=int, default=128)
    work.add_argument("--output-sigma", type=float, default=1.0)
    work.add_argument("--scale", type=float, default=1.0)
    work.add_argument("--min-len", type=int, default=100)
    work.add_argument("--max-len", type=int, default=1024)
    work.add_argument(
        "--vocab-size", type=int, default=DEMO_VOCAB, help="prompt ids are drawn below it (default: the demo model's)"
    )
    work.add_argument("--max-model-len", type=int, default=DEMO_MAX_MODEL_LEN)
    work.add_argument("--num-blocks", type=int, help="KV pool in blocks (default: the calibrated server's)")
    work.add_argument("--block-size", type=int, default=SchedulerConfig.block_size)
    work.add_argument("--preemption", default=SchedulerConfig.preemption.value)
    work.add_argument("--no-overlap", action="store_true", help="as bin/serve --no-overlap: never plan ahead")
    work.add_argument("--json", metavar="PATH", help="write the rows as JSON")

    p = argparse.ArgumentParser(prog="sim", description="Simulate Conveyor deployments with its real scheduler.")
    sub = p.add_subparsers(dest="mode", required=True)
    cal = sub.add_parser("calibrate", help="fit the step cost model to bin/bench runs' step records")
    cal.add_argument("inputs", nargs="+", help="bin/bench offline --json files of a profiling server")
    cal.add_argument("--tp", type=int, default=1, help="the runs' tensor-parallel size")
    cal.add_argument("--out", required=True, help="cost model JSON (updated in place: other TP sizes kept)")
    cal.add_argument("--sync-overhead-ms", type=float, help="host ms a plan formed in sync pays (default: keep, or 0)")
    cal.add_argument(
        "--experts",
        type=_experts,
        metavar="E:K",
        help="a mixture-of-experts model's num_experts:num_experts_per_tok (prices expert GEMMs per active expert)",
    )
    run = sub.add_parser("run", parents=[work], help="replay one configuration")
    run.add_argument("--rate", type=float, default=math.inf, help="requests/s, Poisson (default inf: all at once)")
    run.add_argument("--tp", type=int, default=1)
    run.add_argument("--dp", type=int, default=1)
    run.add_argument(
        "--batch-size", "--max-num-seqs", dest="max_num_seqs", type=int, default=SchedulerConfig.max_num_seqs
    )
    run.add_argument(
        "--max-num-batched-tokens",
        "--max-batched-tokens",
        dest="max_batched",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
    )
    sw = sub.add_parser("sweep", parents=[work], help="the cheapest configuration meeting a target")
    sw.add_argument("--rate", type=float, required=True, help="target requests/s (Poisson arrivals)")
    sw.add_argument("--slo-ttft-ms", type=float, required=True, help="bound on p99 time to first token")
    sw.add_argument("--slo-tpot-ms", type=float, required=True, help="bound on p99 time per output token")
    sw.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (each needs a cost model)")
    sw.add_argument("--dp", default="1,2,4,8", help="data-parallel replica counts")
    sw.add_argument("--max-num-seqs", default="32,64,128,256")
    sw.add_argument("--max-num-batched-tokens", default="2048")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "calibrate":
        sync = None if args.sync_overhead_ms is None else args.sync_overhead_ms / 1e3
        model = calibrate(args.inputs, args.tp, args.out, sync, args.experts)
        c = model.by_tp[args.tp]
        coefs = ", ".join(f"{k} {v * 1e6:.3f} us" for k, v in c.coef_s.items())
        print(f"tp {args.tp}: {c.num_steps} steps, intercept {c.intercept_s * 1e3:.3f} ms, {coefs}; "
              f"residual {c.rel_rmse:.1%} of the mean step; KV pool {c.num_blocks} blocks -> {args.out}")  # fmt: skip
        return 0
    model = CostModel.load(args.cost)
    if args.mode == "run":
        requests = workload_requests(args, args.rate)
        rows = [run_once(args, model, requests, args.tp, args.dp, args.max_num_seqs, args.max_batched)]
        print(table(rows))
        best = None
    else:
        requests = workload_requests(args, args.rate)
        rows, best = sweep(
            args, model, requests, _ints(args.tp), _ints(args.dp), _ints(args.max_num_seqs),
            _ints(args.max_num_batched_tokens), args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3,
        )  # fmt: skip
        print(f"target: {args.rate:g} req/s, p99 TTFT <= {args.slo_ttft_ms:g} ms, p99 TPOT <= {args.slo_tpot_ms:g} ms")
        print(table(rows))
        if best is None:
            print("no configuration tried meets the target")
        else:
            print(f"cheapest: tp {best['tp']} x dp {best['dp']} = {best['gpus']} GPUs, max_num_seqs "
                f"{best['max_num_seqs']}, "
                  f"max_num_batched_tokens {best['max_num_batched_tokens']}")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "cheapest": best}, f, indent=1)
    return 0 if args.mode != "sweep" or best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
