#!/usr/bin/env python3
"""Everything a lent GPU owes the project, as stages under one global deadline.

bench/gpu_checks.sh installs the carried wheels and runs this driver (stdlib only, so it
runs even where a package it checks for is missing). The device tool gives a command at
most 600 s and a session 15 minutes of device time in all, a machine's start included, so
the run is shaped to lose nothing that finished and to deliver in its first window:

- a preflight (at most 30 s: nvidia-smi, the import of conveyor, torch, triton,
  transformers and every module of bench/gpu-wheels.txt, the versions, the commit from
  bench/COMMIT or git) stops the run at once, exit status 2, with each missing piece named
  and what to do (`make gpu-wheels`, carry .whl), instead of letting every later stage fail;
- the stages (bench/gpu_stages.py: the plan, its order and limits, windows 1 and 2) run each
  under ``timeout -s INT`` (pytest and bin/bench print why they stop on SIGINT, not on
  SIGTERM); a stage whose limit would cross the deadline is skipped, and the summary says so;
- after every stage the results folder (logs, JSON, kept serve logs) and the summary are
  packed into ``$OUT/gpu-results.tgz`` beside ``$OUT/summary.txt`` (bench/gpu_summary.py);
- the checkpoint is built once and every later stage reads it.

``--cpu`` is every stage of both windows with CPU flags on a tiny checkpoint, each under a
CPU-sized limit: CI runs it (tests/bench/test_gpu_checks.py), so only GPU-specific failures
are left for a GPU window. Exit status: 2 preflight failed, 1 some stage failed or was
skipped, 0 all passed. docs/gpu-first-light.md gives the device tool's call.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_stages import REPO, WINDOWS, Stage, stages
from gpu_summary import Outcome, write_summary

PREFLIGHT_S = 30
KILL_GRACE_S = 10  # after the SIGINT, timeout's SIGKILL
GPU_DEADLINE_S = 420
CPU_SKIPPED = "skipped: --cpu:"  # a stage the dry run leaves out on purpose (Stage.cpu_skip): not a failure
BASE_MODULES = ("conveyor", "torch", "triton", "transformers")
#: The wheels a window carries: requirement and module per line; `make gpu-wheels` fetches them.
WHEELS = REPO / "bench" / "gpu-wheels.txt"
VERSIONS = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        print(f"MISSING {name}: {type(exc).__name__}: {exc}")
    else:
        print(name, getattr(module, "__version__", "?"))
if "torch" in sys.modules:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cpu", action="store_true", help="dry run on CPU: every stage of both windows, tiny checkpoint, CPU flags"
    )
    p.add_argument(
        "--window",
        type=int,
        choices=WINDOWS,
        default=1,
        help="the GPU stages of this window (1: the first call of a session; 2: compiled HF, a later call)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        help=f"seconds for the whole run (default {GPU_DEADLINE_S}; --cpu: every stage's limit added up)",
    )
    p.add_argument("--out", type=Path, help="where the tgz and summary land (default $OUT, else bench/out/gpu)")
    p.add_argument(
        "--stages",
        help="comma-separated stages to run, from any window, in the plan's order (default: "
        "the window's; a rerun that continues a window: the checkpoint stage and those not reached)",
    )
    p.add_argument("--work", type=Path, help="results and checkpoint folder (default: a new temporary one)")
    sub = p.add_subparsers(dest="command")
    ck = sub.add_parser("checkpoint", help="(a stage) write the benchmark checkpoint")
    ck.add_argument("directory", type=Path)
    ck.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or REPO / "bench" / "out" / "gpu")
    return args


def write_checkpoint(directory: Path, tiny: bool) -> None:
    """The 1B-class bf16 Llama of the targets (bench/decode_step.py's MODEL_1B), or a tiny
    float32 one for --cpu, with the demo tokenizer: every stage reads this one directory."""
    import decode_step  # the model's one definition (bench/ is this script's folder, first on sys.path)
    import torch

    config = dict(decode_step.MODEL_SMOKE if tiny else decode_step.MODEL_1B)
    config["vocab_size"] = 4096  # the demo tokenizer's
    decode_step.write_checkpoint(config, torch.float32 if tiny else torch.bfloat16, directory, tokenizer=True)


def commit() -> str:
    """bench/COMMIT when the tree was sent without .git (write it before sending), else git's."""
    path = REPO / "bench" / "COMMIT"
    if path.exists():
        return path.read_text().strip() + " (bench/COMMIT)"
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no bench/COMMIT, no git)"
    if out.returncode:
        return "unknown (no bench/COMMIT, not a git checkout)"
    return out.stdout.strip() + (" plus uncommitted changes" if dirty.stdout.strip() else "")


def carried_modules() -> dict[str, str]:
    """bench/gpu-wheels.txt's modules, each with its requirement."""
    pairs = (line.split() for line in WHEELS.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {module: requirement for requirement, module in pairs}


def preflight(cpu: bool, results: Path, env: dict[str, str]) -> list[str]:
    """Problems that would make every later stage fail; the versions go to device.txt."""
    problems, lines = [], [f"commit {commit()}"]
    if not cpu:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            problems.append("nvidia-smi not found: no NVIDIA driver on this machine")
        else:
            try:
                r = subprocess.run(
                    [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                lines.append(f"gpu {r.stdout.strip() or r.stderr.strip()}")
                if r.returncode or not r.stdout.strip():
                    problems.append(f"nvidia-smi failed (rc {r.returncode}): {r.stderr.strip()[:200]}")
            except subprocess.TimeoutExpired:
                problems.append("nvidia-smi did not answer in 10 s")
    carried = carried_modules()
    modules = [*BASE_MODULES, *carried]
    try:
        r = subprocess.run(
            [sys.executable, "-c", VERSIONS, *modules],
            capture_output=True,
            text=True,
            timeout=PREFLIGHT_S - 10,
            cwd=REPO,
            env=env,
        )
        lines += r.stdout.strip().splitlines()
        for line in r.stdout.splitlines():
            if line.startswith("MISSING "):
                name = line.split()[1].rstrip(":")
                fix = (
                    (
                        f" (carry its wheel: `make gpu-wheels` fetches {carried[name]} into .whl/, which the call's "
                        "carry must name)"
                    )
                    if name in carried
                    else ""
                )
                problems.append(line.removeprefix("MISSING ") + fix)
        if r.returncode:
            problems.append(f"the version check failed (rc {r.returncode}): {r.stderr.strip()[-300:]}")
        elif not cpu and "available True" not in r.stdout:
            problems.append("torch sees no CUDA device")
    except subprocess.TimeoutExpired:
        problems.append(f"importing {', '.join(modules)} took over {PREFLIGHT_S - 10} s")
    (results / "device.txt").write_text("\n".join(lines + [f"problem: {p}" for p in problems]) + "\n")
    return problems


def run_stage(stage: Stage, results: Path, env: dict[str, str]) -> Outcome:
    log = results / f"{stage.name}.log"
    start = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = ["timeout", "-s", "INT", "-k", str(KILL_GRACE_S), str(stage.limit_s), *stage.command]
    stage_env = {**env, **stage.env}
    if "PYTHONPATH" in stage.env:  # the stage's folders first, the run's after them
        stage_env["PYTHONPATH"] = os.pathsep.join(filter(None, [stage.env["PYTHONPATH"], env.get("PYTHONPATH")]))
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=stage_env
        ).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    status = "passed" if rc == 0 else f"timed out after {stage.limit_s} s" if rc in (124, 137) else f"failed (rc {rc})"
    return Outcome(stage.name, status, time.monotonic() - start, cpu_s)


def select(plan: list[Stage], args: argparse.Namespace) -> tuple[list[Stage], list[str]] | str:
    """The stages this run runs, and header lines saying what was left out; or an error."""
    if args.stages:
        chosen = {name.strip() for name in args.stages.split(",") if name.strip()}
        unknown = chosen - {s.name for s in plan}
        if unknown:
            return (
                f"gpu_checks: unknown stage(s) {', '.join(sorted(unknown))}; the plan: "
                f"{', '.join(s.name for s in plan)}"
            )
        picked = [s for s in plan if s.name in chosen]
        return picked, [f"stages not selected: {', '.join(s.name for s in plan if s.name not in chosen) or 'none'}"]
    if args.cpu:
        return plan, []
    picked = [s for s in plan if s.window == args.window or s.name == "checkpoint"]
    later = [s.name for s in plan if s not in picked]
    return picked, [f"window {args.window}; other windows' stages: {', '.join(later) or 'none'}"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "checkpoint":
        write_checkpoint(args.directory, args.tiny)
        return 0
    begin = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="conveyor-gpu-checks-"))
    results, checkpoint = work / "results", work / "checkpoint"
    results.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CONVEYOR_SERVE_LOG_DIR": str(results / "serve-logs")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    selected = select(stages(args.cpu, results, checkpoint, work), args)
    if isinstance(selected, str):
        print(selected, file=sys.stderr)
        return 2
    plan, notes = selected
    if args.deadline is None:
        args.deadline = PREFLIGHT_S + sum(s.limit_s for s in plan if not s.cpu_skip) if args.cpu else GPU_DEADLINE_S
    header = [
        f"bench/gpu_checks {'--cpu ' if args.cpu else ''}deadline {args.deadline:.0f} s, commit {commit()}",
        *notes,
    ]
    names = ["preflight", *(s.name for s in plan)]
    print(f"== preflight (at most {PREFLIGHT_S} s)", flush=True)
    problems = preflight(args.cpu, results, env)
    device = (results / "device.txt").read_text()
    print(device, end="", flush=True)
    header += device.strip().splitlines()
    if problems:
        message = "PREFLIGHT FAILED, nothing else run: " + "; ".join(problems)
        print(message, file=sys.stderr, flush=True)
        write_summary(args.out, results, [*header, message], [Outcome("preflight", "failed")], names)
        return 2
    outcomes = [Outcome("preflight", "passed", time.monotonic() - begin)]
    write_summary(args.out, results, header, outcomes, names)
    for stage in plan:
        elapsed = time.monotonic() - begin
        if args.cpu and stage.cpu_skip:
            outcome = Outcome(stage.name, f"{CPU_SKIPPED} {stage.cpu_skip}")
        elif elapsed + stage.limit_s > args.deadline:
            outcome = Outcome(
                stage.name,
                f"skipped: its {stage.limit_s} s limit would cross the deadline ({args.deadline - elapsed:.0f} s left)",
            )
        else:
            print(f"== {stage.name} (limit {stage.limit_s} s, at +{elapsed:.0f} s)", flush=True)
            outcome = run_stage(stage, results, env)
            tail = (results / f"{stage.name}.log").read_text(errors="replace").splitlines()[-3:]
            print("\n".join(f"   {line}" for line in tail), flush=True)
        print(f"   {stage.name}: {outcome.status}", flush=True)
        outcomes.append(outcome)
        write_summary(args.out, results, header, outcomes, names)
    print((results / "summary.txt").read_text(), flush=True)
    print(f"done in {time.monotonic() - begin:.0f} s; results in {args.out}/gpu-results.tgz", flush=True)
    return 0 if all(o.status == "passed" or o.status.startswith(CPU_SKIPPED) for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
