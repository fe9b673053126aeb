"""bench/gpu_checks.py's summary and packing: what a window brings back.

The device tool returns at most a few files from ``$OUT``, and a call stopped at its limit
still returns what ``$OUT`` held; so after every stage the results folder is packed into
``$OUT/gpu-results.tgz`` beside ``$OUT/summary.txt``, each replaced whole. The summary lists
every stage's outcome (ran, failed, timed out, or skipped and why), then the figures: the
smoke stage's decode step first (the figure that matters most), then each bench stage's
throughput (with the Triton compiles inside its reported window), the decode-step grid, LoRA.

stdlib only, like the driver.
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Outcome:
    name: str
    status: str  # passed, failed (rc N), timed out after N s, skipped: why
    seconds: float = 0.0
    cpu_s: float = 0.0  # the stage's processes' CPU seconds (what the dry run costs CI)


def smoke_lines(data: dict) -> list[str]:
    start = data.get("startup") or {}
    lines = [
        f"smoke ({data.get('device')} {data.get('dtype')}): graphs runner in {start.get('graphs_runner_s')} s, "
        f"{start.get('graphs')} graphs captured in {start.get('capture_s')} s"
    ]
    for r in data.get("decode_step", []):
        lines.append(
            f"  decode step {'graphs' if r['graphs'] else 'eager '} batch {r['batch']:>3} ctx {data.get('context')}: "
            f"{r['median_ms']:.3f} ms (min {r['min_ms']:.3f}; target {r.get('target_ms')})"
        )
    greedy = data.get("greedy")
    if greedy:
        lines.append(
            f"  greedy graphs == eager: {greedy['graphs_equal_eager']} (prompts of {greedy['prompt_lens']} tokens)"
        )
    return lines


def bench_lines(name: str, data: dict) -> list[str]:
    """Per-token ms is batch / output tok/s (prefill included), the same rule for every system,
    so Conveyor and compiled HF line up at batch 1 and 8."""
    lines = []
    batch = (data.get("settings") or {}).get("batch_size")
    for system, result in (data.get("systems") or {}).items():
        median = result.get("median")
        if not median:
            lines.append(f"{name}: {system} unavailable: {result.get('unavailable')}")
            continue
        tok_s = median.get("output_tok_s") or 0.0
        idle = median.get("worker_idle_fraction")
        per_token = f"{1e3 * batch / tok_s:.2f}" if tok_s and batch else "-"
        line = f"{name}: {system} batch {batch}: {tok_s:,.0f} out tok/s, per-token {per_token} ms" + (
            f", worker idle {100 * idle:.1f}%" if idle is not None else ""
        )
        windows = (result.get("extra") or {}).get("timed_runs")
        if windows and len(windows) > 1:
            line += " (timed runs " + ", ".join(f"{w['output_tok_s']:,.0f}" for w in windows) + " tok/s"
            line += (
                "; Triton compiles in each: "
                + ", ".join("n/a" if w["triton_compiles"] is None else str(w["triton_compiles"]) for w in windows)
                + ")"
            )
        lines.append(line)
    return lines


def figures(results: Path) -> list[str]:
    """The summary's figures, the smoke stage's first."""
    loaded = {}
    for path in sorted(results.glob("*.json")):
        try:
            loaded[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    lines = smoke_lines(loaded.pop("smoke")) if "smoke" in loaded else []
    for name, data in loaded.items():
        if name == "decode_step":
            lines.append(
                f"decode_step ({data.get('versions', {}).get('device')}, "
                f"copy {data.get('copy_bandwidth_gbps', 0):.0f} GB/s):"
            )
            for r in data.get("rows", []):
                hf = r.get("hf_ms")
                lines.append(
                    f"  {'graphs' if r['graphs'] else 'eager '} batch {r['batch']:>3} ctx {r['context']:>4}: "
                    f"{r['median_ms']:.3f} ms (roofline {r['roofline_ms']:.3f}, HF "
                    f"{hf if hf is None else round(hf, 3)})"
                )
        elif name == "moe":
            target = data.get("target", {})
            lines.append(
                f"moe ({data.get('device')} {data.get('dtype')}, {data.get('shape')}): "
                + ", ".join(f"batch {r['batch']} {r['moe_over_dense']}x dense" for r in data.get("rows", []))
                + f" (target <= {target.get('moe_over_dense_at_most')}x"
                + f" at batch {target.get('batch')}: {target.get('met')})"
            )
        elif name == "batch_invariance":
            lines.append(data.get("summary_line", "batch_invariance: no summary line"))
        elif name == "lora":
            lines.append(
                f"lora ({data.get('device')} {data.get('dtype')}, {data.get('adapters')} adapters): "
                f"adapters/base {data.get('adapters_over_base')}x, base/plain {data.get('base_over_plain')}x"
            )
        elif "systems" in data:
            lines += bench_lines(name, data)
    return lines


def write_summary(out: Path, results: Path, header: list[str], outcomes: list[Outcome], planned: list[str]) -> None:
    done = {o.name for o in outcomes}
    lines = [*header, "", "stages:"]
    for o in outcomes:
        spent = f" in {o.seconds:.0f} s" + (f" ({o.cpu_s:.0f} CPU s)" if o.cpu_s else "") if o.seconds else ""
        lines.append(f"  {o.name:<16} {o.status}{spent}")
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
