"""Where a benchmark ran and what it found: environment facts, text tables, the JSON file.

A number without its machine is not a result: the JSON always carries the CPU, core count,
memory, device, library versions, the git commit (and whether the tree was dirty) and the
load average when the run began, since on a shared machine that explains much variance.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git() -> dict[str, Any]:
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": run("rev-parse", "HEAD") or None, "dirty": bool(run("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict[str, Any]:
    device_name = "cpu"
    if device.startswith("cuda"):
        import torch

        device_name = torch.cuda.get_device_name(0)
    return {
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_model(),
            "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_gib": _memory_gib(),
            "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "device": {"kind": device, "name": device_name},
        "versions": {
            "python": sys.version.split()[0],
            "conveyor": _version("conveyor"),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "numpy": _version("numpy"),
            "pyzmq": _version("pyzmq"),
        },
        "git": _git(),
    }


def aggregate(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """Median (and min, max) over repeats of each scalar figure in ``keys``."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_min"] = min(values)
            out[f"{key}_max"] = max(values)
    return out


OFFLINE_KEYS = (
    "output_tok_s", "total_tok_s", "req_s", "wall_s", "mean_batch_occupancy", "worker_idle_fraction",
    "spec_acceptance_rate", "spec_mean_acceptance_length",
)  # fmt: skip


def worker_idle_fraction(server_profile: dict[str, Any] | None) -> float | None:
    """The worker's idle fraction over the run (time waiting for a plan / wall time), from
    the server profile a served run saves; None without one (in-process systems, --no-profile)."""
    return ((server_profile or {}).get("worker") or {}).get("values", {}).get("idle_fraction")


def offline_table(systems: dict[str, dict[str, Any]], reference: str = "conveyor") -> tuple[str, dict[str, Any]]:
    """The offline table and the ratios of each system's output throughput to ``reference``'s.

    The table shows one of the two ratios, ``reference``'s speedup over each system
    (reference / system throughput); the JSON ratios keep both, as earlier results do."""
    ref = systems.get(reference, {}).get("median", {}).get("output_tok_s")
    # With --repeat, the throughput column holds each system's min/median/max over its runs.
    repeated = any(len(r.get("runs", ())) > 1 for r in systems.values())
    tok_head, tok_width = ("out tok/s min/med/max", 21) if repeated else ("out tok/s", 10)
    header = (
        f"{'system':<16} {tok_head:>{tok_width}} {'total tok/s':>11} {'req/s':>7} {'wall s':>8} "
        f"{'lat p50 s':>9} {'lat p99 s':>9} {'occupancy':>9} {reference + ' speedup':>16} "
        f"{'worker idle':>11}"
    )
    lines = [header, "-" * len(header)]
    ratios: dict[str, Any] = {}
    for name, result in systems.items():
        if "unavailable" in result:
            lines.append(f"{name:<16} n/a: {result['unavailable']}")
            continue
        med = result["median"]
        last = result["runs"][-1]
        tok = med["output_tok_s"]
        ratio = tok / ref if ref else None
        speedup = ref / tok if ref and tok else None
        ratios[name] = {"throughput_vs_" + reference: ratio, reference + "_speedup": speedup}
        tok_cell = f"{tok:.1f}"
        if repeated:
            tok_cell = f"{med['output_tok_s_min']:.1f}/{tok:.1f}/{med['output_tok_s_max']:.1f}"
        occupancy = med.get("mean_batch_occupancy")
        idle = med.get("worker_idle_fraction")
        notes = ""
        if "spec_acceptance_rate" in med:  # a speculating server (--serve-arg --speculative-method ...)
            notes = (
                f"  speculation: acceptance {med['spec_acceptance_rate']:.2f}, mean length "
                f"{med['spec_mean_acceptance_length']:.2f}"
            )
        lines.append(
            f"{name:<16} {tok_cell:>{tok_width}} {med['total_tok_s']:>11.1f} {med['req_s']:>7.2f} "
            f"{med['wall_s']:>8.2f} "
            f"{_opt(last['latency_s']['p50'])} {_opt(last['latency_s']['p99'])} "
            f"{_opt(occupancy, 9, 1)} {_opt(speedup, 15, 2)}x "
            f"{_opt(None if idle is None else 100 * idle, 10, 1)}%{notes}"
        )
    return "\n".join(lines), ratios


# A comparison needs at least this much of a run (bin/bench warns under it, the numbers stay):
# the first batch filling and the last draining look alike for every way of batching, so a run
# of few batches measures them and the start-up more than the batching; and under ~10 s a shared
# machine's load swings and one-off costs (first steps, caches warming) are a large share.
MIN_BATCHES = 4
MIN_WALL_S = 10.0


def too_short(num_requests: int, batch_size: int, walls_s: dict[str, float]) -> str | None:
    """A one-line warning when a run is too short to compare systems (see MIN_BATCHES,
    MIN_WALL_S) saying what minimum it is under; None when it is long enough.
    ``walls_s``: each system's (median) wall time."""
    reasons = []
    if num_requests < MIN_BATCHES * batch_size:
        reasons.append(
            f"{num_requests} requests are {num_requests / batch_size:.2g} batches of {batch_size} "
            f"(at least {MIN_BATCHES}: --num-requests {MIN_BATCHES * batch_size})"
        )
    short = {name: wall for name, wall in walls_s.items() if wall < MIN_WALL_S}
    if short:
        ran = ", ".join(f"{name} {wall:.1f} s" for name, wall in short.items())
        reasons.append(f"{ran} (at least {MIN_WALL_S:g} s each)")
    if not reasons:
        return None
    return "warning: this run is too short for its ratios to mean anything: " + "; ".join(reasons)


def add_online_ratios(runs: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    """Each run's output throughput over ``reference``'s run at the same rate in the same
    repeat, stored in its summary as ``throughput_vs_<reference>``; returned per system and
    rate with the median and every run's value (runs alternate, so each pair shares the
    machine's state of its moment)."""
    key = f"throughput_vs_{reference}"
    refs = {(r["repeat"], r["summary"]["rate"]): r["summary"]["output_tok_s"] for r in runs if r["system"] == reference}
    by: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        ref = refs.get((run["repeat"], run["summary"]["rate"]))
        if not ref:
            continue
        ratio = run["summary"]["output_tok_s"] / ref
        run["summary"][key] = ratio
        by.setdefault(run["system"], {}).setdefault(str(run["summary"]["rate"]), []).append(ratio)
    return {
        system: {rate: {key: statistics.median(values), "runs": values} for rate, values in rates.items()}
        for system, rates in by.items()
    }


def online_table(rows: list[tuple[str, dict[str, Any]]], reference: str | None = None) -> str:
    """One line per run; with ``reference``, a last column of each run's output throughput
    relative to ``reference``'s (see :func:`add_online_ratios`)."""
    key = f"throughput_vs_{reference}"
    header = (
        f"{'system':<16} {'rate':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p90/p99 ms':>22} "
        f"{'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'E2E p50/p99 s':>15} {'goodput':>8} {'SLO':>5}"
    )
    if reference:
        header += f" {'x ' + reference:>12}"
    lines = [header, "-" * len(header)]
    for name, s in rows:
        if "unavailable" in s:
            lines.append(f"{name:<16} n/a: {s['unavailable']}")
            continue
        ttft, tpot, itl, e2e = s["ttft_s"], s["tpot_s"], s["itl_s"], s["e2e_s"]
        rate = s["rate"] if isinstance(s["rate"], str) else f"{s['rate']:g}"
        attain = s["slo_attainment"]
        line = (
            f"{name:<16} {rate:>6} {s['req_s']:>7.2f} {s['output_tok_s']:>10.1f} "
            f"{_ms(ttft['p50'])}/{_ms(ttft['p90'])}/{_ms(ttft['p99'])} {'':>2}"
            f"{_ms(tpot['p50'])}/{_ms(tpot['p99'])} {'':>2}{_ms(itl['p50'])}/{_ms(itl['p99'])} "
            f"{_opt(e2e['p50'], 7, 2)}/{_opt(e2e['p99'], 7, 2)} {s['goodput_req_s']:>8.2f} "
            f"{'' if attain is None else f'{attain:.0%}':>5}"
        )
        if reference:
            line += f" {_opt(s.get(key), 12, 3)}"
        lines.append(line)
    return "\n".join(lines)


def online_spread_table(runs: list[dict[str, Any]]) -> str:
    """With ``--repeat``: per system and rate, output tok/s and TPOT p99 as min/median/max over
    the repeats, the noise a single run's line cannot show; empty when each ran once."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["system"], run["summary"]["rate"]), []).append(run["summary"])
    if all(len(summaries) < 2 for summaries in groups.values()):
        return ""

    def spread(values: list[float], digits: int) -> str:
        if not values:
            return "-"
        return "/".join(f"{v:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))

    header = f"{'system':<16} {'rate':>6} {'runs':>4} {'out tok/s min/med/max':>23} {'TPOT p99 ms min/med/max':>25}"
    lines = [header, "-" * len(header)]
    for (name, rate), summaries in groups.items():
        tok = [s["output_tok_s"] for s in summaries]
        tpot = [s["tpot_s"]["p99"] * 1e3 for s in summaries if s["tpot_s"]["p99"] is not None]
        rate_text = rate if isinstance(rate, str) else f"{rate:g}"
        lines.append(f"{name:<16} {rate_text:>6} {len(summaries):>4} {spread(tok, 1):>23} {spread(tpot, 1):>25}")
    return "\n".join(lines)


CPU_COLUMNS = ("load_generator", "http", "frontend", "scheduler", "worker")


def online_cpu_table(runs: list[dict[str, Any]]) -> str:
    """CPU microseconds per output token of each process in each run (empty when no run
    measured any): where a difference in throughput between two systems is spent."""
    measured = [r for r in runs if r.get("extra", {}).get("cpu_us_per_token")]
    if not measured:
        return ""
    header = f"{'CPU us/token':<16} {'rate':>6} " + " ".join(f"{c:>14}" for c in CPU_COLUMNS) + f" {'total':>9}"
    lines = [header, "-" * len(header)]
    for run in measured:
        cpu = run["extra"]["cpu_us_per_token"]
        rate = run["summary"]["rate"]
        rate = rate if isinstance(rate, str) else f"{rate:g}"
        cells = " ".join(_opt(cpu.get(c), 14, 1) for c in CPU_COLUMNS)
        lines.append(f"{run['system']:<16} {rate:>6} {cells} {sum(cpu.values()):>9.1f}")
    return "\n".join(lines)


def _opt(value: float | None, width: int = 9, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}"


def _ms(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value * 1e3:>6.1f}"


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Floats keep 6 significant digits (microseconds on a 100 s run): the files are committed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_rounded(payload), indent=1, default=_jsonable)
    # Arrays of scalars (latencies, timelines) on one line each: indented, they triple the size.
    # JSON strings hold no raw newline, so only separators between elements are rewritten.
    text = _SCALAR_ARRAY.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1).strip()) + "]", text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


_SCALAR_ARRAY = re.compile(r"\[([^\[\]{}]*)\]")


def _rounded(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
