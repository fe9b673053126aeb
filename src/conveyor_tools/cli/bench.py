"""bin/bench: Conveyor against static batching and HF transformers, same model, same requests.

    bin/bench offline --workload high-variance --num-requests 128 --systems conveyor,static,hf,hf-cb \\
        --json bench/results/offline.json --plot bench/results/offline
    bin/bench online --rate 1,2,4 --num-requests 64 --systems conveyor,static
    bin/bench online --address tcp://127.0.0.1:7700 --rate 2        # a server you started
    bin/bench online --http --rate inf --batch-size 64 --repeat 3    # conveyor vs conveyor-http
    bin/bench experiments --threads 1 --out bench/results/experiments-cpu   # docs/experiments.md
    bin/bench speculative --threads 1 --repeat 3     # speculative decoding on/off at batch 1, 8, 64

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

This module holds the offline and online commands and `main`; the parser and the systems
table are in :mod:`conveyor_tools.cli.bench_options`, the experiments command in
:mod:`conveyor_tools.cli.bench_experiments`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from typing import Any

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.ipc.messages import speculation_rates
from conveyor.worker.main import resolve_device
from conveyor_tools.bench import experiments, llama_server, plots, report, roofline, vllm_server
from conveyor_tools.bench.busy_cores import busy_cores, load_label
from conveyor_tools.bench.drivers import run_offline, run_online
from conveyor_tools.bench.run_metrics import OfflineRun
from conveyor_tools.bench.server import BenchServer
from conveyor_tools.bench.workloads import (
    Workload,
    constrain_fraction,
    poisson_arrivals,
    retokenized,
    with_controls,
    with_logprobs,
    workload_from_args,
)
from conveyor_tools.cli.bench_experiments import experiments_main
from conveyor_tools.cli.bench_options import (
    ALL_SYSTEMS,
    EXTERNAL_HTTP,
    HTTP_SERVED,
    IN_PROCESS,
    SERVED,
    build_parser,
    checkpoint_dir,
    model_settings,
    progress_bar,
    serve_flags,
)
from conveyor_tools.cli.bench_speculative import speculative_main

# --warmup workload: the warm-up requests' output cap (enough decode steps to overlap the
# batch's prefill chunks, as the timed run's first steps do).
WARMUP_MAX_TOKENS = 32


def offline_serve_args(args: argparse.Namespace, model_dir: str, device: str, system: str) -> list[str]:
    """bin/serve's flags for served ``system`` in an offline run: ``static`` gathers a full
    batch (``--batch-size`` waiting, or the oldest waited a bounded time) before it admits,
    as in the experiments (:func:`conveyor_tools.bench.experiments.offline_gate` says why), so
    its first batch, and the static/continuous ratio, do not depend on how fast the requests
    reached the scheduler."""
    return serve_flags(args, model_dir, device, SERVED[system] + experiments.offline_gate(system, args.batch_size))


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
    bandwidth = roofline.copy_bandwidth()  # before any server runs: the decode roofline's
    for name in systems:
        if name in HTTP_SERVED or name in EXTERNAL_HTTP:
            results[name] = {"unavailable": "online only: bin/bench online drives the HTTP API"}
    hf_model = None
    vocab = ctx["vocab_size"]
    warmup = None
    if args.warmup == "workload":
        first = Workload(workload.name, workload.seed, workload.requests[: args.batch_size], workload.params)
        warmup = retokenized(first, workload.seed + 1, vocab, max_output_len=WARMUP_MAX_TOKENS)
    reruns = [retokenized(workload, workload.seed + 2 + k, vocab) for k in range(args.timed_runs - 1)]
    for rep in range(args.repeat):
        for name in systems:
            if "unavailable" in results[name]:
                continue
            desc = name if args.repeat == 1 else f"{name} [{rep + 1}/{args.repeat}]"
            try:  # the progress bar starts once the system is up: its rate and ETA are the run's alone
                if name in SERVED:
                    with BenchServer(offline_serve_args(args, model_dir, device, name)) as server:
                        with progress_bar(args, len(workload.requests), desc) as bar:
                            run = asyncio.run(
                                run_offline(
                                    name, server.address, workload, bar, args.timeout, warmup=warmup, reruns=reruns
                                )
                            )
                else:
                    from conveyor_tools.bench import hf

                    if hf_model is None:
                        if args.threads:
                            import torch

                            torch.set_num_threads(args.threads)
                        hf_model = hf.load_model(model_dir, device, args.dtype)
                    with progress_bar(args, len(workload.requests), desc) as bar:
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
            counters = run.extra.get("scheduler_counters") or {}
            if counters.get("spec_num_proposals"):  # the server speculated: its acceptance
                record["summary"].update(speculation_rates(counters))
            if "timed_runs" in run.extra:  # the reported (last) window's compiles
                record["summary"]["triton_compiles"] = run.extra["timed_runs"][-1]["triton_compiles"]
            results[name]["runs"].append(record["summary"])
            results[name].update({k: v for k, v in record.items() if k != "summary"})
    for name, result in results.items():
        if "unavailable" not in result:
            result["median"] = report.aggregate(result["runs"], report.OFFLINE_KEYS)
    table, ratios = report.offline_table(results)
    walls = {name: r["median"]["wall_s"] for name, r in results.items() if "wall_s" in r.get("median", {})}
    warning = report.too_short(len(workload.requests), args.batch_size, walls)
    print()
    print(table)
    config = ModelConfig.from_dir(model_dir)
    dtype_bytes = roofline.dtype_bytes_of(args.dtype, device, config)
    for name, result in results.items():
        steps = (result.get("extra") or {}).get("step_records")
        if steps and (rows := roofline.decode_roofline(steps, config, dtype_bytes, bandwidth)):
            result["decode_roofline"] = rows
            print()
            print(roofline.roofline_table(name, rows, bandwidth))
    if warning:
        print(warning)
    return {
        "systems": results, "ratios": ratios, "table": table, "copy_bandwidth_gbps": bandwidth / 1e9,
        **({"warning": warning} if warning else {}),
    }  # fmt: skip


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
        elif name in EXTERNAL_HTTP:
            targets.append((name, [], ""))
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
    # A busy run's prompts are fresh tokens of the same lengths (the same for every system): the
    # quiet run before it on the same server would otherwise leave them all in the prefix cache.
    busy_workload = retokenized(workload, workload.seed + 100, ctx["vocab_size"]) if args.busy_cores else workload
    for rep in range(args.repeat):
        for name, extra, http_url in targets:
            if name in failed:
                continue
            server = None
            try:
                if name == "llama-server":
                    longest = max(r.prompt_len + r.output_len for r in workload.requests)
                    binary = args.llama_server or llama_server.DEFAULT_BINARY
                    model_file = llama_server.gguf_file(args.model)
                    server = llama_server.LlamaServer(binary, model_file, args.batch_size, longest + 16, args.threads)
                elif name in EXTERNAL_HTTP:
                    python = args.vllm_python or vllm_server.default_python(vllm_server.REPO)
                    server = vllm_server.VllmServer(
                        python, model_dir, args.batch_size, args.max_batched_tokens, args.threads
                    )
                elif extra is not None:
                    server = BenchServer(serve_flags(args, model_dir, device, extra))
                if server is not None:
                    server.start()
                address = args.address if server is None else server.address
                if http_url == "":
                    http_url = server.http_url
                    if not http_url:
                        raise RuntimeError(f"bin/serve printed no HTTP API address:\n{server.log_tail()}")
                for rate, busy in [(r, b) for r in rates for b in dict.fromkeys((0, args.busy_cores))]:
                    arrivals = poisson_arrivals(len(workload.requests), rate, args.seed)
                    label = f"{name} @ {load_label(rate, busy)}/s"
                    label += "" if args.repeat == 1 else f" [{rep + 1}/{args.repeat}]"
                    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
                    probe = None if server is None else server.cpu_seconds
                    with progress_bar(args, len(workload.requests), label) as bar, busy_cores(busy):
                        load = busy_workload if busy else workload
                        job = run_online(
                            name, address, load, arrivals, rate, *slo, bar, args.timeout, probe, http_url=http_url
                        )
                        run = asyncio.run(job)
                    summary = run.summary()
                    summary["rate"] = load_label(summary["rate"], busy)
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
    names = [name for name, _, _ in targets]
    reference = "server" if args.address else "conveyor" if "conveyor" in names or not names else names[0]
    ratios = report.add_online_ratios(runs, reference)
    table = report.online_table(rows, reference if len(ratios) > 1 else None)
    cpu = report.online_cpu_table(runs)
    walls: dict[str, float] = {}  # each system and rate's shortest run
    for r in runs:
        label = f"{r['system']} @ {r['summary']['rate']}/s"
        walls[label] = min(walls.get(label, math.inf), r["summary"]["wall_s"])
    warning = report.too_short(len(workload.requests), args.batch_size, walls)
    spread = report.online_spread_table(runs)
    print()
    print(table)
    if spread:
        print()
        print(spread)
    if cpu:
        print()
        print(cpu)
    if warning:
        print(warning)
    return {
        **({"warning": warning} if warning else {}),
        "runs": runs,
        "table": table,
        "ratios": ratios,
        "unavailable": {n: s["unavailable"] for n, s in rows if "unavailable" in s},
    }


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Unwinds like Ctrl-C, so every server this benchmark started is stopped on the way out.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    if args.mode == "experiments":
        return experiments_main(args, argv)
    if args.mode == "speculative":
        return speculative_main(args, argv)
    default = "conveyor,static,hf,hf-cb" if args.mode == "offline" else "conveyor"
    systems = [s.strip() for s in (args.systems or default).split(",") if s.strip()]
    if getattr(args, "http", False) and "conveyor-http" not in systems:
        systems.append("conveyor-http")
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        print(f"bench: unknown system(s) {', '.join(unknown)}; choose from {', '.join(ALL_SYSTEMS)}", file=sys.stderr)
        return 2
    if args.repeat < 1 or getattr(args, "timed_runs", 1) < 1:
        print("bench: --repeat and --timed-runs must be at least 1", file=sys.stderr)
        return 2
    if args.mode == "online" and args.http_url and not args.address:
        print("bench: --http-url is for a running server: give its --address too", file=sys.stderr)
        return 2
    if args.plot and (missing := plots.missing_requirement()):
        print(f"bench: --plot: {missing}", file=sys.stderr)
        return 2
    model_dir = checkpoint_dir(args)
    model = ModelConfig.from_dir(model_dir)
    try:
        device = resolve_device(args.device)  # bin/serve's rule, so every system runs on the same device
    except (RuntimeError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    max_model_len = args.max_model_len or model.max_position_embeddings
    workload = workload_from_args(args, vocab_size=model.vocab_size, max_model_len=max_model_len)
    # Only the conveyor systems driven over ZeroMQ send these fields (not HF, not conveyor-http).
    for flag, fraction, mark in (
        ("--controls-fraction", args.controls_fraction, with_controls),
        ("--constrained-fraction", args.constrained_fraction, constrain_fraction),
    ):
        if fraction:
            unsupported = [
                name for name in systems if name.startswith("hf") or name in ("conveyor-http", *EXTERNAL_HTTP)
            ]
            if unsupported or not 0 <= fraction <= 1:
                print(
                    f"bench: {flag} needs a value in [0, 1] and conveyor systems (not {unsupported})", file=sys.stderr
                )
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
    ctx = {
        "workload": workload,
        "systems": systems,
        "device": device,
        "model_dir": model_dir,
        "vocab_size": model.vocab_size,
    }
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
            "kv_cache_dtype": args.kv_cache_dtype,
            "threads": args.threads,
            "max_model_len": max_model_len,
            "repeat": getattr(args, "repeat", 1),
            "warmup": getattr(args, "warmup", "short"),
            "timed_runs": getattr(args, "timed_runs", 1),
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
