"""PNG plots of a benchmark (matplotlib, installed with the ``bench`` extra; imported only here).

Offline: output throughput per system; the CDF of request completion latency; and the
batch-occupancy timeline, sequences in the batch over time, per system: the picture of
static batching draining to its one long request while continuous batching refills.
Online: TTFT and end-to-end latency CDFs per system and rate, and throughput vs rate.
With ``--repeat``, the throughput plots show the spread: the median with the min-max range
(offline, also each run's value), so a difference inside the noise looks like one.
Experiments (bin/bench experiments): one figure per experiment, continuous beside static.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DPI = 80  # small PNGs: they are committed under bench/results/
#: The two ways of batching the experiments compare, in their colours' order (C0, C1).
BATCHING = ("continuous", "static")


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


def _cdf_figure(
    plt, curves: list[tuple[list[float], str]], xlabel: str, title: str, legend_size: int, path: Path
) -> str:
    """One figure of empirical CDFs, one step curve per (values, label); an empty curve is left out."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for values, label in curves:
        if values:
            x = np.sort(np.asarray(values))
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
    return _finish(plt, fig, ax, path, title, xlabel, "fraction of requests", legend_size)


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
    for i, (bar, name) in enumerate(zip(bars, names)):
        x, runs = bar.get_x() + bar.get_width() / 2, [r["output_tok_s"] for r in ran[name]["runs"]]
        if len(runs) > 1:  # the spread over --repeat: every run's value, and the min-max range
            ax.errorbar(
                [x],
                [values[i]],
                yerr=[[values[i] - min(runs)], [max(runs) - values[i]]],
                color="black",
                capsize=4,
                lw=1,
            )
            ax.plot([x] * len(runs), runs, "k.", ms=4)
        ax.annotate(f"{values[i]:.0f}", (x, max(runs)), ha="center", va="bottom", fontsize=8)
    repeats = max(len(r["runs"]) for r in ran.values()) if ran else 1
    ax.set_ylabel("output tokens / s" + (f" (median of {repeats}, min-max)" if repeats > 1 else ""))
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
        fig, axes = plt.subplots(
            len(with_timeline), 1, figsize=(7, 1.6 * len(with_timeline) + 0.6), sharex=True, squeeze=False
        )
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
    for key, label, fname in (
        ("ttft_s", "time to first token (s)", "ttft_cdf.png"),
        ("e2e_s", "end-to-end latency (s)", "e2e_cdf.png"),
    ):
        curves = [(run["raw"][key], f"{run['system']} @ {run['summary']['rate']}/s") for run in runs]
        written.append(_cdf_figure(plt, curves, label, f"{label}: {title}", 7, out / fname))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    systems = sorted({run["system"] for run in runs})
    for name in systems:
        by_rate: dict[str, list[tuple[float, float]]] = {}  # the --repeat runs of each offered rate
        for run in runs:
            if run["system"] == name:
                by_rate.setdefault(str(run["summary"]["rate"]), []).append(
                    (run["summary"]["req_s"], run["summary"]["output_tok_s"])
                )
        pts = sorted((float(np.median([p[0] for p in ps])), [p[1] for p in ps]) for ps in by_rate.values())
        x, tok = [p[0] for p in pts], [p[1] for p in pts]
        med = [float(np.median(t)) for t in tok]
        spread = [[m - min(t) for m, t in zip(med, tok)], [max(t) - m for m, t in zip(med, tok)]]
        ax.errorbar(
            x,
            med,
            yerr=spread,
            marker="o",
            capsize=3,
            label=name + (" (median, min-max)" if max(map(len, tok)) > 1 else ""),
        )
    written.append(
        _finish(
            plt,
            fig,
            ax,
            out / "online_throughput.png",
            f"Throughput vs load: {title}",
            "achieved requests / s",
            "output tokens / s",
        )
    )
    return written


def _finish(plt, fig, ax, path: Path, title: str, xlabel: str | None, ylabel: str, legend_size: int = 8) -> str:
    """Labels (no x label where the ticks say it all), title, legend and layout of a one-axes
    figure whose curves or bars are labelled, then saved: every such figure looks alike."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig, path: Path, plt) -> str:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return str(path)


def plot_experiments(out_dir: str, payload: dict[str, Any]) -> list[str]:
    """The figures of ``bin/bench experiments`` (docs/experiments.md), one per experiment
    that ran: throughput over batch size, latency percentiles, the occupancy timeline both
    ways, KV blocks held over time both ways, and the throughput ratio over output spread."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables, runs = payload["tables"], payload["runs"]
    device = payload["environment"]["device"]["name"]
    written = []

    def row_figure(key: str, draw: Callable[[Any, list[dict[str, Any]]], tuple[str | None, str]], title: str) -> None:
        """Experiment ``key``'s figure: one axes over its table's rows, drawn by ``draw``."""
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xlabel, ylabel = draw(ax, tables[key]["rows"])
        written.append(_finish(plt, fig, ax, out / f"{key}.png", title, xlabel, ylabel))

    if "1_throughput" in tables:
        row_figure("1_throughput", _throughput_over_batch, f"1. Throughput over batch size ({device})")
    if "2_latency" in tables:
        rate = tables["2_latency"]["rate_req_s"]
        row_figure("2_latency", _latency_percentiles, f"2. Latency at {rate or 0:.2f} req/s ({device})")

    focus = payload["settings"]["sizes"]["focus_batch"]
    focus_runs = {s: runs.get(f"{s}/b{focus}/sharegpt", {}) for s in BATCHING}
    if "3_occupancy" in tables and all(r.get("timeline", {}).get("t_s") for r in focus_runs.values()):
        fig, axes = plt.subplots(2, 1, figsize=(7, 3.8), sharex=True)
        for i, (ax, (name, run)) in enumerate(zip(axes, focus_runs.items())):
            tl = run["timeline"]
            ax.step(tl["t_s"], tl["running"], where="post", lw=0.7, color=f"C{i}")
            ax.axhline(focus, color="grey", lw=0.6, ls="--")
            ax.set_ylim(0, focus * 1.1)
            ax.set_ylabel(name, fontsize=8, rotation=0, ha="right", va="center")
        axes[-1].set_xlabel("time since the run started (s)")
        axes[0].set_title(f"3. Sequences in the batch per step, max {focus} ({device})", fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, out / "3_occupancy.png", plt))

    if "4_kv" in tables and all(r.get("kv", {}).get("available") for r in focus_runs.values()):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for i, (name, run) in enumerate(focus_runs.items()):
            series = run["kv"]["series"]
            ax.step(series["t_s"], series["held_blocks"], where="post", lw=0.7, color=f"C{i}", label=name)
        title = f"4. KV blocks held, batch {focus} ({device})"
        written.append(
            _finish(plt, fig, ax, out / "4_kv_blocks.png", title, "time since the run started (s)", "KV blocks held")
        )

    if "5_variance" in tables:
        row_figure("5_variance", _ratio_over_spread, f"5. Output-length spread at one mean ({device})")
    return written


def _throughput_over_batch(ax, rows: list[dict[str, Any]]) -> tuple[str | None, str]:
    """Experiment 1: output tok/s over batch size both ways, each ratio written at its point."""
    for i, name in enumerate(BATCHING):
        pts = [(r["batch_size"], r[f"{name}_tok_s"]) for r in rows if r[f"{name}_tok_s"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=name)
    for r in rows:
        if r["ratio"] is not None:
            ax.annotate(f"{r['ratio']:.2f}x", (r["batch_size"], r["continuous_tok_s"]), fontsize=7, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["batch_size"] for r in rows], [str(r["batch_size"]) for r in rows])
    return "batch size (max_num_seqs)", "output tokens / s"


def _latency_percentiles(ax, rows: list[dict[str, Any]]) -> tuple[str | None, str]:
    """Experiment 2: end-to-end latency at each percentile, a bar each way."""
    x = np.arange(len(rows))
    for i, name in enumerate(BATCHING):
        ax.bar(x + (i - 0.5) * 0.4, [r[f"{name}_s"] or 0.0 for r in rows], 0.4, color=f"C{i}", label=name)
    ax.set_xticks(x, [f"p{r['percentile']}" for r in rows])
    return None, "end-to-end latency (s)"


def _ratio_over_spread(ax, rows: list[dict[str, Any]]) -> tuple[str | None, str]:
    """Experiment 5: our continuous / static throughput ratio beside the published one, per spread."""
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["ratio"] or 0.0 for r in rows], 0.4, color="C0", label="ours")
    ax.bar(x + 0.2, [r["published"] for r in rows], 0.4, color="C7", label="published")
    ax.set_xticks(x, [f"{r['spread']}\ncv {r['output_len_cv'] or 0:.2f}" for r in rows])
    return None, "continuous / static throughput"
