"""bin/bench: Conveyor against static batching and HF transformers, same model, same requests.

    bin/bench offline --workload high-variance --num-requests 128 --systems conveyor,static,hf,hf-cb \\
        --json bench/results/offline.json --plot bench/results/offline
    bin/bench online --rate 1,2,4 --num-requests 64 --systems conveyor,static
    bin/bench online --address tcp://127.0.0.1:7700 --rate 2        # a server you started
    bin/bench online --http --rate inf --batch-size 64 --repeat 3    # conveyor vs conveyor-http
    bin/bench experiments --threads 1 --out bench/results/experiments-cpu   # docs/experiments.md

Systems: ``conveyor`` (bin/serve, continuous batching, started by the benchmark),
``static`` (bin/serve --batching static; offline, behind the experiments' gate: it gathers a
full batch before admitting, so no run depends on arrival timing), ``conveyor-noprof`` (bin/serve --no-profile: with
``conveyor`` it measures what profiling costs), ``conveyor-nooverlap`` (bin/serve
--no-overlap: with ``conveyor`` it measures what planning ahead buys; the table's worker
idle column is the worker's idle fraction from the server profile), ``conveyor-zmq``
(bin/serve --plan-transport zmq: plans and results on ZeroMQ instead of shared memory),
``conveyor-http`` (online only: bin/serve --http-port on a free port, the same load as
streamed ``/v1/completions`` through the OpenAI HTTP API; with ``conveyor`` it measures what
the HTTP face costs; ``--http`` adds it), ``hf`` (transformers ``generate`` on padded
batches), ``hf-compiled`` (the same with a static KV cache, compiled on CUDA: CUDA graphs)
and ``hf-cb`` (transformers continuous batching). Every system gets the same
concurrency cap, ``--batch-size``: the server's --max-num-seqs, the padded batch size, and
hf-cb's max requests per batch. A system that cannot run here is reported as such, with
the reason; no number is ever invented for it. docs/benchmarks.md has the method and results.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from conveyor_tools.bench import experiment_tables, experiments, plots, report
from conveyor_tools.bench.drivers import run_offline, run_online
from conveyor_tools.bench.http_driver import run_online_http
from conveyor_tools.bench.run_metrics import OfflineRun
from conveyor_tools.bench.server import BenchServer
from conveyor_tools.bench.workloads import WORKLOADS, constrain_fraction, make_workload, poisson_arrivals, with_controls, with_logprobs
from conveyor.checkpoints.model_config import ModelConfig
from conveyor.runtime.build import GIB
from conveyor.runtime.config import Device, Dtype, WorkerConfig
from conveyor.worker.main import resolve_device

SERVED = {
    "conveyor": [],
    "static": ["--batching", "static"],
    "conveyor-noprof": ["--no-profile"],
    "conveyor-nooverlap": ["--no-overlap"],
    "conveyor-zmq": ["--plan-transport", "zmq"],
}
# Served, and driven through the OpenAI HTTP API instead of the ZeroMQ client (online only).
HTTP_SERVED = {"conveyor-http": ["--http-port", "0"]}
IN_PROCESS = ("hf", "hf-compiled", "hf-cb")
ALL_SYSTEMS = (*SERVED, *HTTP_SERVED, *IN_PROCESS)
TIMEOUT_S = 3600.0


def build_parser() -> argparse.ArgumentParser:
    # What every mode shares: the model, the device and the server's sizes.
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--model", help="HF checkpoint directory (default: the built-in demo model)")
    engine.add_argument("--device", default="auto", choices=Device.names())
    engine.add_argument("--dtype", default="auto", choices=Dtype.names())
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=int, help="prompt + output limit (default: the model's)")
    engine.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step (conveyor, hf-cb)")
    engine.add_argument(
        "--kv-cache-memory", type=float, default=WorkerConfig.kv_cache_memory_bytes / GIB, help="GiB of KV cache (conveyor, hf-cb)"
    )
    engine.add_argument("--threads", type=int, help="torch CPU threads (server worker and in-process HF alike)")
    engine.add_argument("--serve-arg", action="append", default=[], help="extra bin/serve argument (repeatable)")
    engine.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    engine.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds a server may stay silent")

    common = argparse.ArgumentParser(add_help=False, parents=[engine])
    common.add_argument("--systems", default=None, help=f"comma-separated, from {', '.join(ALL_SYSTEMS)}")
    common.add_argument("--workload", default="high-variance", choices=WORKLOADS)
    common.add_argument("--num-requests", type=int, default=64)
    common.add_argument("--prompt-len", type=int, default=128, help="fixed and lognormal workloads")
    common.add_argument("--output-len", type=int, default=128, help="fixed workload; lognormal workload's mean")
    common.add_argument("--output-sigma", type=float, default=1.0, help="lognormal workload: log-space spread of outputs")
    common.add_argument(
        "--logprobs-fraction", type=float, default=0.0, help="this fraction of the requests asks for --logprobs (Conveyor systems)"
    )
    common.add_argument("--logprobs", type=int, default=5, help="top log-probabilities those requests ask for")
    common.add_argument("--scale", type=float, default=1.0, help="sharegpt workload: lengths times this")
    common.add_argument("--min-len", type=int, default=100, help="uniform workload")
    common.add_argument("--max-len", type=int, default=1024, help="uniform workload")
    common.add_argument("--batch-size", type=int, default=32, help="concurrency cap of every system")
    common.add_argument(
        "--controls-fraction",
        type=float,
        default=0.0,
        help="share of requests sent with sampling controls (penalties, logit_bias); conveyor systems only",
    )
    common.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        help="share of requests under a JSON schema (structured output); conveyor systems only",
    )
    common.add_argument("--json", metavar="PATH", help="write the results, machine and versions as JSON")
    common.add_argument("--plot", metavar="DIR", help="write PNG plots (needs matplotlib: the bench extra)")

    p = argparse.ArgumentParser(prog="bench", description="Benchmark Conveyor against baselines.")
    sub = p.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline", parents=[common], help="all requests at once: throughput")
    off.add_argument("--repeat", type=int, default=1, help="runs per system, interleaved; the median is reported")
    on = sub.add_parser("online", parents=[common], help="Poisson arrivals: latency and goodput")
    on.add_argument("--rate", default="4", help="requests/s; a comma-separated sweep; 'inf' for all at once")
    on.add_argument("--address", help="benchmark this running server instead of starting one")
    on.add_argument("--http", action="store_true", help="also drive the load through the OpenAI HTTP API (adds conveyor-http)")
    on.add_argument("--http-url", help="with --address: that server's HTTP API (e.g. http://127.0.0.1:8000), also driven")
    on.add_argument("--repeat", type=int, default=1, help="runs per system, alternating (a fresh server each)")
    on.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput target: time to first token")
    on.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput target: time per output token")
    exp = sub.add_parser(
        "experiments", parents=[engine], help="the continuous-batching write-ups' tables: continuous vs static"
    )
    exp.add_argument("--out", metavar="DIR", help="write experiments.json, tables.txt and the PNG plots here")
    exp.add_argument("--only", help="comma-separated experiment numbers, from 1,2,3,4,5 (default: all)")
    exp.add_argument("--quick", action="store_true", help="small sizes (a smoke run for CI, on a tiny checkpoint)")
    exp.add_argument("--batch-sizes", help="experiment 1's sweep, comma-separated (default 8,16,32,64,128)")
    exp.add_argument("--batch-size", type=int, help="batch size of experiments 2-5 (default 32)")
    exp.add_argument("--batches", type=int, help="experiment 1: requests per run = this x the batch size (default 6)")
    exp.add_argument("--scale", type=float, help="ShareGPT lengths (means 161/338 tokens, clip 1024) times this (default 0.5)")
    exp.add_argument("--num-requests", type=int, help="requests of experiment 2 (default 160) and of each spread of experiment 5 (default 512)")
    exp.add_argument("--rate", type=float, help="experiment 2's arrival rate, req/s (default: --load x continuous capacity)")
    exp.add_argument("--load", type=float, help="experiment 2's rate as a fraction of continuous capacity (default 0.7)")
    exp.add_argument("--prompt-len", type=int, help="experiment 5's prompt length (default 32)")
    exp.add_argument("--mean-output", type=int, help="experiment 5's mean output length (default 96)")
    return p


def _progress(args: argparse.Namespace, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=args.no_progress, file=sys.stderr, leave=True)


def _serve_args(args: argparse.Namespace, model_dir: str, device: str, extra: list[str]) -> list[str]:
    out = [
        "--model", model_dir,
        "--device", device,
        "--dtype", args.dtype,
        "--max-num-seqs", str(args.batch_size),
        "--max-num-batched-tokens", str(args.max_batched_tokens),
        "--kv-cache-memory", str(args.kv_cache_memory),
    ]  # fmt: skip
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.max_model_len:
        out += ["--max-model-len", str(args.max_model_len)]
    return out + extra + list(args.serve_arg)


def offline_serve_args(args: argparse.Namespace, model_dir: str, device: str, system: str) -> list[str]:
    """bin/serve's flags for served ``system`` in an offline run: ``static`` gathers a full
    batch (``--batch-size`` waiting, or the oldest waited a bounded time) before it admits,
    as in the experiments (:func:`conveyor_tools.bench.experiments.offline_gate` says why), so
    its first batch, and the static/continuous ratio, do not depend on how fast the requests
    reached the scheduler."""
    return _serve_args(args, model_dir, device, SERVED[system] + experiments.offline_gate(system, args.batch_size))


def _run_record(run: OfflineRun) -> dict[str, Any]:
    return {
        "summary": run.summary(),
        "latencies_s": run.latencies_s,
        "timeline": run.timeline.to_json(),
        "extra": run.extra,
    }


def offline(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    workload, systems, device, model_dir = ctx["workload"], ctx["systems"], ctx["device"], ctx["model_dir"]
    results: dict[str, dict[str, Any]] = {name: {"runs": []} for name in systems}
    for name in systems:
        if name in HTTP_SERVED:
            results[name] = {"unavailable": "online only: bin/bench online drives the HTTP API"}
    hf_model = None
    for rep in range(args.repeat):
        for name in systems:
            if "unavailable" in results[name]:
                continue
            desc = name if args.repeat == 1 else f"{name} [{rep + 1}/{args.repeat}]"
            with _progress(args, len(workload.requests), desc) as bar:
                try:
                    if name in SERVED:
                        with BenchServer(offline_serve_args(args, model_dir, device, name)) as server:
                            run = asyncio.run(run_offline(name, server.address, workload, bar, args.timeout))
                    else:
                        from conveyor_tools.bench import hf

                        if hf_model is None:
                            if args.threads:
                                import torch

                                torch.set_num_threads(args.threads)
                            hf_model = hf.load_model(model_dir, device, args.dtype)
                        if name in ("hf", "hf-compiled"):
                            run = hf.run_hf_generate(
                                hf_model, workload, args.batch_size, bar, static_cache=name == "hf-compiled"
                            )
                        else:
                            run = hf.run_hf_cb(
                                hf_model, workload, args.batch_size, args.max_batched_tokens, args.kv_cache_memory, bar
                            )
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # report, never invent a number
                    reason = f"{type(exc).__name__}: {exc}".strip()
                    print(f"\n{name} could not run: {reason}", file=sys.stderr)
                    results[name] = {"unavailable": reason.splitlines()[0][:300], "detail": reason[:4000]}
                    continue
            record = _run_record(run)
            idle = report.worker_idle_fraction(run.extra.get("server_profile"))
            if idle is not None:
                record["summary"]["worker_idle_fraction"] = idle
            results[name]["runs"].append(record["summary"])
            results[name].update({k: v for k, v in record.items() if k != "summary"})
    for name, result in results.items():
        if "unavailable" not in result:
            result["median"] = report.aggregate(result["runs"], report.OFFLINE_KEYS)
    table, ratios = report.offline_table(results)
    print()
    print(table)
    return {"systems": results, "ratios": ratios, "table": table}


def _online_targets(args: argparse.Namespace, systems: list[str]) -> list[tuple[str, list[str] | None, str | None]]:
    """(system, bin/serve arguments or None for the running server, HTTP URL or None for ZeroMQ)."""
    if args.address:
        targets = [("server", None, None)]
        if args.http_url:
            targets.append(("server-http", None, args.http_url.rstrip("/")))
        return targets
    targets = []
    for name in systems:
        if name in SERVED:
            targets.append((name, SERVED[name], None))
        elif name in HTTP_SERVED:
            targets.append((name, HTTP_SERVED[name], ""))  # the URL: what the server prints
    return targets


def online(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    workload, systems, device, model_dir = ctx["workload"], ctx["systems"], ctx["device"], ctx["model_dir"]
    rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rate.split(",")]
    targets = _online_targets(args, systems)
    runs: list[dict[str, Any]] = []
    rows: list[tuple[str, dict[str, Any]]] = []
    for name in systems:
        if name in IN_PROCESS:
            note = "no server: online runs go through the ZeroMQ client to a bin/serve"
            rows.append((name, {"unavailable": note}))
    failed: set[str] = set()
    for rep in range(args.repeat):
        for name, extra, http_url in targets:
            if name in failed:
                continue
            server = None if extra is None else BenchServer(_serve_args(args, model_dir, device, extra))
            try:
                if server is not None:
                    server.start()
                address = args.address if server is None else server.address
                if http_url == "":
                    http_url = server.http_url
                    if not http_url:
                        raise RuntimeError(f"bin/serve printed no HTTP API address:\n{server.log_tail()}")
                for rate in rates:
                    arrivals = poisson_arrivals(len(workload.requests), rate, args.seed)
                    label = f"{name} @ {rate:g}/s" + ("" if args.repeat == 1 else f" [{rep + 1}/{args.repeat}]")
                    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
                    probe = None if server is None else server.cpu_seconds
                    with _progress(args, len(workload.requests), label) as bar:
                        if http_url is None:
                            job = run_online(name, address, workload, arrivals, rate, *slo, bar, args.timeout, probe)
                        else:
                            job = run_online_http(
                                name, http_url, address, workload, arrivals, rate, *slo, bar, args.timeout, probe
                            )
                        run = asyncio.run(job)
                    summary = run.summary()
                    done = [r for r in run.requests if r.ok]
                    raw = {
                        "ttft_s": [r.ttft for r in done if r.ttft is not None],
                        "e2e_s": [r.e2e for r in done],
                        "tpot_s": [r.tpot for r in done if r.tpot is not None],
                    }
                    runs.append({"system": name, "repeat": rep, "summary": summary, "raw": raw, "extra": run.extra})
                    rows.append((name, summary))
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                print(f"\n{name} could not run: {reason}", file=sys.stderr)
                rows.append((name, {"unavailable": reason.splitlines()[0][:300]}))
                failed.add(name)
            finally:
                if server is not None:
                    server.stop()
    reference = "server" if args.address else "conveyor"
    ratios = report.add_online_ratios(runs, reference)
    table = report.online_table(rows, reference if len(ratios) > 1 else None)
    cpu = report.online_cpu_table(runs)
    print()
    print(table)
    if cpu:
        print()
        print(cpu)
    return {
        "runs": runs,
        "table": table,
        "ratios": ratios,
        "unavailable": {n: s["unavailable"] for n, s in rows if "unavailable" in s},
    }


def _model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir

    return str(demo_checkpoint_dir())


def _serve_flag(args: argparse.Namespace, flag: str) -> str | None:
    """The value a --serve-arg gives bin/serve's ``flag`` (``--flag V`` or ``--flag=V``), or None."""
    extra = list(args.serve_arg)
    for i, arg in enumerate(extra):
        if arg == flag and i + 1 < len(extra):
            return extra[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _experiment_sizes(args: argparse.Namespace) -> experiments.Sizes:
    """--quick's or the full sizes, with each size flag given replacing its default."""
    base = experiments.QUICK if args.quick else experiments.FULL
    changes: dict[str, Any] = {
        "focus_batch": args.batch_size,
        "batches_per_run": args.batches,
        "sharegpt_scale": args.scale,
        "online_requests": args.num_requests,
        "spread_requests": args.num_requests,
        "load": args.load,
        "spread_prompt_len": args.prompt_len,
        "spread_mean_output": args.mean_output,
    }
    if args.batch_sizes:
        changes["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(","))
    return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})


def experiments_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """bin/bench experiments: run, print the tables, write JSON, tables and plots to --out."""
    try:
        only = {int(x) for x in args.only.split(",")} if args.only else set(experiments.EXPERIMENTS)
        sizes = _experiment_sizes(args)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if not only <= set(experiments.EXPERIMENTS):
        print(f"bench: --only takes experiment numbers from 1,2,3,4,5, got {args.only}", file=sys.stderr)
        return 2
    if min(sizes.batch_sizes) < 1 or sizes.focus_batch < 1 or sizes.batches_per_run < 1:
        print("bench: batch sizes and --batches must be positive", file=sys.stderr)
        return 2
    model_dir = _model_dir(args)
    model = ModelConfig.from_dir(model_dir)
    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    import torch

    from conveyor.runtime.config import SchedulerConfig
    from conveyor.worker.loader import resolve_dtype

    block_size = int(_serve_flag(args, "--block-size") or SchedulerConfig.block_size)
    dtype_bytes = torch.empty((), dtype=resolve_dtype(args.dtype, device, model)).element_size()
    kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes

    def serve_args(system: str, batch_size: int) -> list[str]:
        sized = argparse.Namespace(**{**vars(args), "batch_size": batch_size})
        return _serve_args(sized, model_dir, device, SERVED["conveyor" if system == "continuous" else "static"])

    def progress(total: int, label: str):
        return _progress(args, total, label)

    setup = experiments.Setup(
        serve_args=serve_args,
        progress=progress,
        vocab_size=model.vocab_size,
        max_model_len=args.max_model_len or model.max_position_embeddings,
        seed=args.seed,
        timeout=args.timeout,
        block_size=block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        rate=args.rate,
    )
    print(
        f"bench experiments {','.join(map(str, sorted(only)))}: model {'demo' if not args.model else model_dir} "
        f"({model.architecture}, {model.num_layers} layers, hidden {model.hidden_size}) on {device}",
        file=sys.stderr,
    )
    env = report.environment(device)
    result = experiments.Experiments(setup, sizes, only).run()
    if hasattr(os, "getloadavg"):
        env["machine"]["load_average_at_end"] = list(os.getloadavg())
    text = experiment_tables.format_tables(result["tables"], env, args.threads)
    print()
    print(text)
    unavailable = {k: r["unavailable"] for k, r in result["runs"].items() if "unavailable" in r}
    payload = {
        "benchmark": "experiments",
        "command": " ".join(["bin/bench", *(argv if argv is not None else sys.argv[1:])]),
        "settings": {
            "model": "demo" if not args.model else model_dir,
            "model_config": model_settings(model),
            "device": device,
            "dtype": args.dtype,
            "experiments": sorted(only),
            "sizes": experiments.sizes_json(sizes),
            "max_batched_tokens": args.max_batched_tokens,
            "kv_cache_memory_gib": args.kv_cache_memory,
            "block_size": block_size,
            "threads": args.threads,
            "max_model_len": setup.max_model_len,
            "serve_args": list(args.serve_arg),
        },
        "environment": env,
        "tables_text": text,
        "unavailable": unavailable,
        **result,
    }
    if args.out:
        out = Path(args.out)
        report.write_json(str(out / "experiments.json"), payload)
        (out / "tables.txt").write_text(text + "\n", encoding="utf-8")
        written = [str(out / "experiments.json"), str(out / "tables.txt")]
        missing = plots.missing_requirement()
        if missing:
            print(f"no plots: {missing}", file=sys.stderr)
        else:
            written += plots.plot_experiments(str(out), payload)
        print(f"written: {', '.join(written)}", file=sys.stderr)
    return 1 if unavailable else 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Unwinds like Ctrl-C, so every server this benchmark started is stopped on the way out.
    raise SystemExit(128 + signum)


def model_settings(model: ModelConfig) -> dict[str, Any]:
    """The model's shape as a result file records it."""
    return {
        "architecture": model.architecture,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    if args.mode == "experiments":
        return experiments_main(args, argv)
    default = "conveyor,static,hf,hf-cb" if args.mode == "offline" else "conveyor"
    systems = [s.strip() for s in (args.systems or default).split(",") if s.strip()]
    if getattr(args, "http", False) and "conveyor-http" not in systems:
        systems.append("conveyor-http")
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        print(f"bench: unknown system(s) {', '.join(unknown)}; choose from {', '.join(ALL_SYSTEMS)}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("bench: --repeat must be at least 1", file=sys.stderr)
        return 2
    if args.mode == "online" and args.http_url and not args.address:
        print("bench: --http-url is for a running server: give its --address too", file=sys.stderr)
        return 2
    if args.plot and (missing := plots.missing_requirement()):
        print(f"bench: --plot: {missing}", file=sys.stderr)
        return 2
    model_dir = _model_dir(args)
    model = ModelConfig.from_dir(model_dir)
    try:
        device = resolve_device(args.device)  # bin/serve's rule, so every system runs on the same device
    except (RuntimeError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    max_model_len = args.max_model_len or model.max_position_embeddings
    workload = make_workload(
        args.workload,
        args.num_requests,
        seed=args.seed,
        vocab_size=model.vocab_size,
        max_model_len=max_model_len,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        min_len=args.min_len,
        max_len=args.max_len,
        scale=args.scale,
        output_sigma=args.output_sigma,
    )
    # Only the conveyor systems driven over ZeroMQ send these fields (not HF, not conveyor-http).
    for flag, fraction, mark in (
        ("--controls-fraction", args.controls_fraction, with_controls),
        ("--constrained-fraction", args.constrained_fraction, constrain_fraction),
    ):
        if fraction:
            unsupported = [name for name in systems if name.startswith("hf") or name == "conveyor-http"]
            if unsupported or not 0 <= fraction <= 1:
                print(f"bench: {flag} needs a value in [0, 1] and conveyor systems (not {unsupported})", file=sys.stderr)
                return 2
            workload = mark(workload, fraction)
    if args.logprobs_fraction:
        if not 0 <= args.logprobs_fraction <= 1:
            print("bench: --logprobs-fraction needs a value in [0, 1]", file=sys.stderr)
            return 2
        workload = with_logprobs(workload, args.logprobs_fraction, args.logprobs)
    described = workload.describe()
    print(
        f"bench {args.mode}: {described['num_requests']} {workload.name} requests (seed {workload.seed}), "
        f"{described['prompt_tokens']} prompt + {described['output_tokens']} output tokens; "
        f"model {'demo' if not args.model else model_dir} ({model.architecture}, {model.num_layers} layers, "
        f"hidden {model.hidden_size}) on {device}; batch size {args.batch_size}",
        file=sys.stderr,
    )
    if workload.num_clamped:
        print(f"note: {workload.num_clamped} requests clamped to max_model_len {max_model_len}", file=sys.stderr)
    env = report.environment(device)
    ctx = {"workload": workload, "systems": systems, "device": device, "model_dir": model_dir}
    result = offline(args, ctx) if args.mode == "offline" else online(args, ctx)
    if hasattr(os, "getloadavg"):
        env["machine"]["load_average_at_end"] = list(os.getloadavg())
    payload = {
        "benchmark": args.mode,
        "command": " ".join(["bin/bench", *(argv if argv is not None else sys.argv[1:])]),
        "workload": described,
        "settings": {
            "systems": systems,
            "model": "demo" if not args.model else model_dir,
            "model_config": model_settings(model),
            "device": device,
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "max_batched_tokens": args.max_batched_tokens,
            "kv_cache_memory_gib": args.kv_cache_memory,
            "threads": args.threads,
            "max_model_len": max_model_len,
            "repeat": getattr(args, "repeat", 1),
        },
        "environment": env,
        **result,
    }
    if args.json:
        report.write_json(args.json, payload)
        print(f"results written to {args.json}", file=sys.stderr)
    if args.plot:
        title = f"{workload.name}, {len(workload.requests)} requests, {device}"
        if args.mode == "offline":
            written = plots.plot_offline(args.plot, title, result["systems"])
        else:
            written = plots.plot_online(args.plot, title, result["runs"])
        print(f"plots written: {', '.join(written)}", file=sys.stderr)
    failed = (
        [n for n, r in result["systems"].items() if "unavailable" in r and n in SERVED]
        if args.mode == "offline"
        else [n for n in result["unavailable"] if n not in IN_PROCESS]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
