"""bin/bench speculative: the command line of :mod:`conveyor_tools.bench.speculative` (the sweep
of batch sizes x workloads x methods on the copy checkpoint), its table and JSON."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.main import resolve_device
from conveyor_tools.bench import report, speculative
from conveyor_tools.bench.copy_model import COPY_WORKLOADS, CYCLE_LEN, copy_checkpoint_dir
from conveyor_tools.cli.bench_options import model_settings, progress_bar, serve_flags


def _settings(args: argparse.Namespace) -> speculative.SpecSettings:
    """The sweep from the flags; ValueError on a bad one."""
    settings = speculative.SpecSettings(
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        num_speculative_tokens=args.num_speculative_tokens,
        batches_per_run=args.batches,
        output_len=args.output_len,
        repeat=args.repeat,
        seed=args.seed,
    )
    if not set(settings.workloads) <= set(COPY_WORKLOADS) or not settings.workloads:
        raise ValueError(f"--workloads: choose from {', '.join(COPY_WORKLOADS)}")
    if not set(settings.methods) <= set(speculative.METHODS) or speculative.OFF not in settings.methods:
        raise ValueError(f"--methods: choose from {', '.join(speculative.METHODS)}, off included (the reference)")
    if min(settings.batch_sizes) < 1 or settings.batches_per_run < 1 or settings.repeat < 1:
        raise ValueError("batch sizes, --batches and --repeat must be positive")
    if not 0 < settings.output_len < CYCLE_LEN or settings.num_speculative_tokens < 1:
        raise ValueError(f"--output-len must be in [1, {CYCLE_LEN - 1}] and --num-speculative-tokens positive")
    return settings


def speculative_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    try:
        settings = _settings(args)
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    model_dir = str(copy_checkpoint_dir())
    model = ModelConfig.from_dir(model_dir)

    def serve_args(batch: int, flags: list[str]) -> list[str]:
        sized = argparse.Namespace(**{**vars(args), "batch_size": batch})
        return serve_flags(sized, model_dir, device, flags)

    def progress(total: int, label: str) -> Any:
        return progress_bar(args, total, label)

    print(f"bench speculative: {settings} on the copy checkpoint {model_dir} ({device})", file=sys.stderr)
    env = report.environment(device)
    cells = speculative.run_sweep(settings, serve_args, model.vocab_size, progress, args.timeout)
    if hasattr(os, "getloadavg"):
        env["machine"]["load_average_at_end"] = list(os.getloadavg())
    text = speculative.table(cells)
    print()
    print(text)
    if args.json:
        report.write_json(args.json, {
            "benchmark": "speculative",
            "command": " ".join(["bin/bench", *(argv if argv is not None else sys.argv[1:])]),
            "settings": {**dataclasses.asdict(settings), "model": "copy", "model_config": model_settings(model),
                         "device": device,
                         "dtype": args.dtype, "threads": args.threads, "serve_args": list(args.serve_arg)},
            "environment": env,
            "table": text,
            "cells": cells,
        })  # fmt: skip
        print(f"results written to {args.json}", file=sys.stderr)
    return 0
