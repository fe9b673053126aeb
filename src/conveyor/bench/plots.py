"""PNG plots of a benchmark (matplotlib, installed with the ``bench`` extra; imported only here).

Offline: output throughput per system; the CDF of request completion latency; and the
batch-occupancy timeline, sequences in the batch over time, per system: the picture of
static batching draining to its one long request while continuous batching refills.
Online: TTFT and end-to-end latency CDFs per system and rate, and throughput vs rate.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

DPI = 80  # small PNGs: they are committed under bench/results/


def missing_requirement() -> str | None:
    """Why plots cannot be drawn here (bin/bench asks before it runs anything), or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return 'plots need matplotlib, which is not installed: pip install -e ".[bench]"'
    return None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf_figure(plt, curves: list[tuple[list[float], str]], xlabel: str, title: str, legend_size: int, path: Path) -> str:
    """One figure of empirical CDFs, one step curve per (values, label); an empty curve is left out."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for values, label in curves:
        if values:
            x = np.sort(np.asarray(values))
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    return _save(fig, path, plt)


def plot_offline(out_dir: str, title: str, systems: dict[str, dict[str, Any]]) -> list[str]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ran = {name: r for name, r in systems.items() if "unavailable" not in r}
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(ran)
    values = [ran[n]["median"]["output_tok_s"] for n in names]
    bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput: {title}", fontsize=9)
    fig.tight_layout()
    written.append(_save(fig, out / "throughput.png", plt))

    written.append(
        _cdf_figure(
            plt,
            [(r["latencies_s"], name) for name, r in ran.items()],
            "request completion time since submission (s)",
            f"Latency CDF: {title}",
            8,
            out / "latency_cdf.png",
        )
    )

    with_timeline = {n: r for n, r in ran.items() if r["timeline"]["t_s"]}
    if with_timeline:
        fig, axes = plt.subplots(len(with_timeline), 1, figsize=(7, 1.6 * len(with_timeline) + 0.6), sharex=True, squeeze=False)
        for ax, (name, r) in zip(axes[:, 0], with_timeline.items()):
            tl = r["timeline"]
            if tl.get("step_function"):
                ax.step(tl["t_s"], tl["running"], where="post", lw=0.8)
            else:
                ax.plot(tl["t_s"], tl["running"], lw=0.6, marker=".", ms=1.5)
            # Horizontal: rotated at this DPI, the hyphen of "hf-cb" is lost.
            ax.set_ylabel(name, fontsize=8, rotation=0, ha="right", va="center")
            ax.set_ylim(bottom=0)
        axes[-1, 0].set_xlabel("time since the run started (s)")
        axes[0, 0].set_title(f"Sequences in the batch per step: {title}", fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, out / "batch_occupancy.png", plt))
    return written


def plot_online(out_dir: str, title: str, runs: list[dict[str, Any]]) -> list[str]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, fname in (("ttft_s", "time to first token (s)", "ttft_cdf.png"), ("e2e_s", "end-to-end latency (s)", "e2e_cdf.png")):
        curves = [(run["raw"][key], f"{run['system']} @ {run['summary']['rate']}/s") for run in runs]
        written.append(_cdf_figure(plt, curves, label, f"{label}: {title}", 7, out / fname))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    systems = sorted({run["system"] for run in runs})
    for name in systems:
        pts = [(run["summary"]["req_s"], run["summary"]["output_tok_s"]) for run in runs if run["system"] == name]
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("achieved requests / s")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput vs load: {title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out / "online_throughput.png", plt))
    return written


def _save(fig, path: Path, plt) -> str:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return str(path)
