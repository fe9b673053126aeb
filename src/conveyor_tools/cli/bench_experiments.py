"""bin/bench experiments: the continuous-batching write-ups' tables (docs/experiments.md),
continuous against static batching, run by :class:`conveyor_tools.bench.experiments.Experiments`;
this module turns the command line into its sizes and setup and writes what it returns."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.main import resolve_device
from conveyor_tools.bench import experiment_tables, experiments, plots, report
from conveyor_tools.cli.bench_options import SERVED, checkpoint_dir, model_settings, progress_bar, serve_flags


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
    model_dir = checkpoint_dir(args)
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
        return serve_flags(sized, model_dir, device, SERVED["conveyor" if system == "continuous" else "static"])

    def progress(total: int, label: str):
        return progress_bar(args, total, label)

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
