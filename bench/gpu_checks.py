#!/usr/bin/env python3
"""Everything a lent GPU owes the project, as stages under one global deadline.

bench/gpu_checks.sh installs the carried wheels and runs this driver (stdlib only, so it
runs even where a package it checks for is missing). The device tool gives a command at
most 600 s and brings back at most 8 files, and a session has 15 minutes of device time in
all, so the run is shaped to lose nothing that finished and to leave time for a rerun:

- a preflight (at most 30 s: nvidia-smi, ``import conveyor, zmq, msgspec, triton``, the
  versions, the commit from bench/COMMIT or git) stops the run at once, exit status 2, with
  the missing piece named, instead of letting every later stage fail on it;
- stages run in the order of what they teach, each under ``timeout -s INT`` (pytest and
  bin/bench print why they stop on SIGINT, not on SIGTERM); a stage whose time limit would
  cross the deadline is skipped, and the summary says so;
- after every stage the results folder (logs, JSON, kept serve logs) and the summary are
  packed into ``$OUT/gpu-results.tgz`` beside ``$OUT/summary.txt``: two files in ``$OUT``
  whatever happens later;
- the 1B checkpoint is built once and every later stage reads it.

``--cpu`` is the same stages with CPU flags on a tiny checkpoint under a 60 s deadline: CI
runs it (tests/bench/test_gpu_checks.py), so only GPU-specific failures are left for a GPU
window. Exit status: 2 preflight failed, 1 some stage failed or was skipped, 0 all passed.
docs/benchmarks.md ("What the GPU owes") says how to run it on the device tool.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFLIGHT_S = 30
CPU_LIMIT_S = 30  # every --cpu stage: a bin/serve start or a torch import alone takes ~15 s on two busy cores
KILL_GRACE_S = 10  # after the SIGINT, timeout's SIGKILL
SPEC_TESTS = "tests/engine/test_verify_step_graphs.py"  # the spec_tests stage's, not gpu_tests'
MODULES = ("conveyor", "zmq", "msgspec", "triton", "torch", "transformers")
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


@dataclass
class Stage:
    name: str
    limit_s: int
    command: list[str]
    outputs: list[str] = field(default_factory=list)  # result files the summary reads


@dataclass
class Outcome:
    name: str
    status: str  # passed, failed (rc), timed out, skipped (why)
    seconds: float = 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="dry run on CPU: tiny checkpoint, CPU flags, 60 s deadline")
    p.add_argument("--deadline", type=float, help="seconds for the whole run (default 420; --cpu: 60)")
    p.add_argument("--out", type=Path, help="where the tgz and summary land (default $OUT, else bench/out/gpu)")
    p.add_argument("--stages", help="comma-separated stages to run, in the plan's order (default: all; "
                   "a rerun that continues a window: the checkpoint stage and those not reached)")
    p.add_argument("--work", type=Path, help="results and checkpoint folder (default: a new temporary one)")
    sub = p.add_subparsers(dest="command")
    ck = sub.add_parser("checkpoint", help="(a stage) write the benchmark checkpoint")
    ck.add_argument("directory", type=Path)
    ck.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    if args.deadline is None:
        args.deadline = 60.0 if args.cpu else 420.0
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or REPO / "bench" / "out" / "gpu")
    return args


def write_checkpoint(directory: Path, tiny: bool) -> None:
    """The 1B-class bf16 Llama of the targets (bench/decode_step.py's MODEL_1B), or a tiny
    float32 one for --cpu, with the demo tokenizer: every stage reads this one directory."""
    sys.path.insert(0, str(REPO / "bench"))
    import decode_step  # the model's one definition
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
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no bench/COMMIT, no git)"
    if out.returncode:
        return "unknown (no bench/COMMIT, not a git checkout)"
    return out.stdout.strip() + (" plus uncommitted changes" if dirty.stdout.strip() else "")


def preflight(cpu: bool, results: Path, env: dict[str, str]) -> list[str]:
    """Problems that would make every later stage fail; the versions go to device.txt."""
    problems, lines = [], [f"commit {commit()}"]
    if not cpu:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            problems.append("nvidia-smi not found: no NVIDIA driver on this machine")
        else:
            try:
                r = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=10)
                lines.append(f"gpu {r.stdout.strip() or r.stderr.strip()}")
                if r.returncode or not r.stdout.strip():
                    problems.append(f"nvidia-smi failed (rc {r.returncode}): {r.stderr.strip()[:200]}")
            except subprocess.TimeoutExpired:
                problems.append("nvidia-smi did not answer in 10 s")
    try:
        r = subprocess.run([sys.executable, "-c", VERSIONS, *MODULES], capture_output=True, text=True,
                           timeout=PREFLIGHT_S - 10, cwd=REPO, env=env)
        lines += r.stdout.strip().splitlines()
        problems += [ln.removeprefix("MISSING ") for ln in r.stdout.splitlines() if ln.startswith("MISSING ")]
        if r.returncode:
            problems.append(f"the version check failed (rc {r.returncode}): {r.stderr.strip()[-300:]}")
        elif not cpu and "available True" not in r.stdout:
            problems.append("torch sees no CUDA device")
    except subprocess.TimeoutExpired:
        problems.append(f"importing {', '.join(MODULES)} took over {PREFLIGHT_S - 10} s")
    (results / "device.txt").write_text("\n".join(lines + [f"problem: {p}" for p in problems]) + "\n")
    return problems


def stages(cpu: bool, results: Path, checkpoint: Path) -> list[Stage]:
    """The run, in the order of what it teaches (docs/benchmarks.md, "What the GPU owes")."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    device = ["--device", "cpu", "--dtype", "float32"] if cpu else ["--device", "cuda", "--dtype", "bfloat16"]
    common = [py, str(REPO / "bin" / "bench"), "offline", "--model", str(checkpoint), *device,
              "--kv-cache-memory", "0.05" if cpu else "20", "--no-progress", "--workload", "fixed"]
    if cpu:
        common += ["--threads", "1"]
    plen, olen = ("16", "8") if cpu else ("128", "128")

    def bench(name: str, systems: str, batch: int, requests: int, gpu_limit: int) -> Stage:
        limit = CPU_LIMIT_S if cpu else gpu_limit
        json_path = str(results / f"{name}.json")
        timeout = str(max(10, limit - 10))  # a silent server fails the call before the stage's limit
        cmd = [*common, "--systems", systems, "--batch-size", str(batch), "--num-requests", str(requests),
               "--prompt-len", plen, "--output-len", olen, "--timeout", timeout, "--json", json_path]
        return Stage(name, limit, cmd, [json_path])

    out = []
    if cpu:  # the gpu-marked tests of one file (they skip here); the collection of all would eat the deadline
        out.append(Stage("gpu_tests", CPU_LIMIT_S, [*pytest, "-m", "gpu", "tests/kernels/test_block_copy.py"]))
    else:  # kernels run in their own stage below, compiled
        out.append(Stage("gpu_tests", 90, [*pytest, "-m", "gpu", "tests", "--ignore=tests/kernels",
                                           f"--ignore={SPEC_TESTS}"]))
    checkpoint_cmd = [py, str(Path(__file__).resolve()), "checkpoint", str(checkpoint)] + (["--tiny"] if cpu else [])
    out.append(Stage("checkpoint", CPU_LIMIT_S if cpu else 40, checkpoint_cmd))
    out.append(bench("conveyor_b128", "conveyor", 4 if cpu else 128, 8 if cpu else 256, 45))
    out.append(bench("conveyor_b1", "conveyor", 1, 2 if cpu else 4, 30))
    out.append(bench("conveyor_b8", "conveyor", 2 if cpu else 8, 4 if cpu else 16, 30))
    # The baselines the decode targets are stated against (issue 24: >= 20x padded HF generate,
    # faster per token at batch 1 than compiled HF), early so that the first window has them.
    out.append(bench("hf", "hf", 4 if cpu else 128, 8 if cpu else 256, 45))
    out.append(bench("hf_compiled_b1", "hf-compiled", 1, 2 if cpu else 4, 60))
    # Structured output (issue 27): the batch of conveyor_b128's size with half its requests under
    # a JSON schema; its throughput over conveyor_b128's is the figure owed (target >= 0.9x).
    half = bench("conveyor_b128_json_half", "conveyor", 4 if cpu else 128, 8 if cpu else 256, 45)
    half.command.extend(["--constrained-fraction", "0.5"])
    out.append(half)
    # conveyor-sim's cost model, fitted to the three runs' per-step records (three batch sizes,
    # so the per-sequence cost is told apart from the per-step floor); seconds, no device.
    cost_json = str(results / "sim_cost.json")
    runs = [str(results / f"conveyor_{b}.json") for b in ("b128", "b1", "b8")]
    out.append(Stage("sim_calibrate", CPU_LIMIT_S if cpu else 20,
                     [py, str(REPO / "bin" / "sim"), "calibrate", *runs, "--out", cost_json], [cost_json]))
    grid = ["--batches", "1", "--contexts", "32", "--steps", "2"] if cpu else \
        ["--batches", "1,32,128", "--contexts", "512,2048", "--steps", "10"]
    step_json = str(results / "decode_step.json")
    out.append(Stage("decode_step", CPU_LIMIT_S if cpu else 70, [py, str(REPO / "bench" / "decode_step.py"), "--checkpoint",
                     str(checkpoint), *(["--device", "cpu", "--dtype", "float32"] if cpu else []), *grid,
                     "--out", step_json], [step_json]))
    # Speculative verify steps through the static buffers (issue 28): their graphs == eager
    # tests, then plain / ragged-verify / static-verify decoding side by side (bench/speculative.py).
    out.append(Stage("spec_tests", CPU_LIMIT_S if cpu else 60, [*pytest, "-m", "gpu", SPEC_TESTS]))
    spec_json = str(results / "speculative.json")
    spec_args = ["--smoke", "--threads", "1"] if cpu else ["--device", "cuda", "--dtype", "bfloat16", "--requests", "8",
                                                          "--prompt-len", "256", "--max-tokens", "64", "--kv-cache-memory", "20"]
    out.append(Stage("speculative", CPU_LIMIT_S if cpu else 75, [py, str(REPO / "bench" / "speculative.py"), "--checkpoint",
                     str(checkpoint), *spec_args, "--out", spec_json], [spec_json]))
    kernels = [*pytest, "tests/kernels/test_block_copy.py" if cpu else "tests/kernels"]
    if importlib.util.find_spec("xdist") is not None and not cpu:
        kernels += ["-n", "8"]
    out.append(Stage("kernels", CPU_LIMIT_S if cpu else 60, kernels))
    # LoRA: the Triton kernels' tests (compiled; the gpu-marked bf16 one at 1B shapes), then 8 adapters
    # over the requests against the base model alone (docs/benchmarks.md); the gpu-marked parity
    # tests against PEFT run in gpu_tests. The bench runs even when a test fails; either fails the stage.
    lora_json = str(results / "lora.json")
    lora_args = ["--requests", "4", "--adapters", "2", "--prompt-len", "8", "--max-tokens", "4", "--repeats", "1"] \
        if cpu else ["--device", "cuda", "--dtype", "bfloat16"]
    lora_tests = [*pytest, *(["-m", "gpu"] if cpu else []), "tests/kernels/test_lora.py"]
    lora_bench = [py, str(REPO / "bench" / "lora.py"), *lora_args, "--out", lora_json]
    out.append(Stage("lora", CPU_LIMIT_S if cpu else 90,
                     ["sh", "-c", f"{shlex.join(lora_tests)}; tests=$?; {shlex.join(lora_bench)} && exit $tests"],
                     [lora_json]))
    out.append(bench("hf_compiled_b8", "hf-compiled", 2 if cpu else 8, 4 if cpu else 16, 60))
    out.append(bench("hf_cb", "hf-cb", 4 if cpu else 128, 8 if cpu else 256, 45))
    out.append(bench("static", "static", 4 if cpu else 128, 8 if cpu else 256, 45))
    return out


def run_stage(stage: Stage, results: Path, env: dict[str, str]) -> Outcome:
    log = results / f"{stage.name}.log"
    start = time.monotonic()
    cmd = ["timeout", "-s", "INT", "-k", str(KILL_GRACE_S), str(stage.limit_s), *stage.command]
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, env=env).returncode
    seconds = time.monotonic() - start
    status = "passed" if rc == 0 else f"timed out after {stage.limit_s} s" if rc in (124, 137) else f"failed (rc {rc})"
    return Outcome(stage.name, status, seconds)


def figures(results: Path) -> list[str]:
    """The summary's figures: throughput, worker idle and per-token latency of each bench
    stage, and the decode-step grid. Per-token ms is batch / output tok/s (prefill included),
    the same rule for every system, so Conveyor and compiled HF line up at batch 1 and 8."""
    lines = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if path.stem == "decode_step":
            lines.append(f"decode_step ({data.get('versions', {}).get('device')}, "
                         f"copy {data.get('copy_bandwidth_gbps', 0):.0f} GB/s):")
            for r in data.get("rows", []):
                hf = r.get("hf_ms")
                lines.append(f"  {'graphs' if r['graphs'] else 'eager '} batch {r['batch']:>3} ctx {r['context']:>4}: "
                             f"{r['median_ms']:.3f} ms (roofline {r['roofline_ms']:.3f}, HF {hf if hf is None else round(hf, 3)})")
            continue
        if path.stem == "lora":
            lines.append(f"lora ({data.get('device')} {data.get('dtype')}, {data.get('adapters')} adapters): "
                         f"adapters/base {data.get('adapters_over_base')}x, base/plain {data.get('base_over_plain')}x")
            continue
        batch = (data.get("settings") or {}).get("batch_size")
        for system, result in (data.get("systems") or {}).items():
            median = result.get("median")
            if not median:
                lines.append(f"{path.stem}: {system} unavailable: {result.get('unavailable')}")
                continue
            tok_s = median.get("output_tok_s") or 0.0
            idle = median.get("worker_idle_fraction")
            per_token = f"{1e3 * batch / tok_s:.2f}" if tok_s and batch else "-"
            lines.append(f"{path.stem}: {system} batch {batch}: {tok_s:,.0f} out tok/s, per-token {per_token} ms"
                         + (f", worker idle {100 * idle:.1f}%" if idle is not None else ""))
    return lines


def write_summary(out: Path, results: Path, header: list[str], outcomes: list[Outcome], planned: list[str]) -> None:
    done = {o.name for o in outcomes}
    lines = [*header, "", "stages:"]
    lines += [f"  {o.name:<16} {o.status}" + (f" in {o.seconds:.0f} s" if o.seconds else "") for o in outcomes]
    lines += [f"  {name:<16} not reached" for name in planned if name not in done]
    lines += ["", *figures(results)]
    text = "\n".join(lines) + "\n"
    (results / "summary.txt").write_text(text)
    pack(out, results, text)


def pack(out: Path, results: Path, summary: str) -> None:
    """$OUT holds gpu-results.tgz and summary.txt and nothing else of ours; each is replaced
    whole (written beside, then renamed), so a run killed mid-pack leaves the last good pair."""
    out.mkdir(parents=True, exist_ok=True)
    partial = out / ".gpu-results.tgz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(results, arcname="gpu-results")
    partial.replace(out / "gpu-results.tgz")
    (out / ".summary.partial").write_text(summary)
    (out / ".summary.partial").replace(out / "summary.txt")


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
    header = [f"bench/gpu_checks {'--cpu ' if args.cpu else ''}deadline {args.deadline:.0f} s, commit {commit()}"]
    plan = stages(args.cpu, results, checkpoint)
    if args.stages:
        chosen = {name.strip() for name in args.stages.split(",") if name.strip()}
        unknown = chosen - {s.name for s in plan}
        if unknown:
            print(f"gpu_checks: unknown stage(s) {', '.join(sorted(unknown))}; the plan: "
                  f"{', '.join(s.name for s in plan)}", file=sys.stderr)
            return 2
        header.append(f"stages not selected: {', '.join(s.name for s in plan if s.name not in chosen) or 'none'}")
        plan = [s for s in plan if s.name in chosen]
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
        if elapsed + stage.limit_s > args.deadline:
            outcome = Outcome(stage.name, f"skipped: its {stage.limit_s} s limit would cross the deadline "
                                          f"({args.deadline - elapsed:.0f} s left)")
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
    return 0 if all(o.status == "passed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
