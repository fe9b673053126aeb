"""What one experiment run's records say about its batches: KV blocks held (:func:`kv_usage`),
the padding static batching would waste (:func:`padded_waste`), batch occupancy
(:func:`occupancy`), latency percentiles. Pure functions of the records, tested alone."""

from __future__ import annotations

from typing import Any

import numpy as np

from conveyor_tools.bench.run_metrics import Timeline
from conveyor_tools.bench.workloads import Workload

LATENCY_PERCENTILES = (50, 90, 95, 99)


def kv_usage(rows: list[dict[str, Any]], start: float, end: float, block_size: int) -> dict[str, Any]:
    """KV blocks held over ``[start, end]`` (Unix seconds) from iteration-log rows.

    Each row's value holds from its time until the next row's (the last until ``end``), so
    the averages are over time. ``slack_tokens`` of a step is ``held_blocks x block_size -
    context_tokens``: KV slots held that hold no token of that step's context. That is the
    unfilled tail of each request's last block, plus the blocks of requests that finish with
    the step still in flight (the plan is formed before that step's result frees them: this
    makes the peaks), plus under static batching members waiting between prefill chunks.
    ``coverage`` is the fraction of the window's steps the poller saw."""
    inside = [r for r in rows if start <= r["time"] <= end]
    if not inside:
        return {"available": False, "reason": "no scheduler iteration inside the run's window"}
    t = np.array([r["time"] for r in inside], dtype=np.float64)
    held = np.array([r["held_blocks"] for r in inside], dtype=np.float64)
    slack = np.maximum(0.0, held * block_size - np.array([r["context_tokens"] for r in inside], dtype=np.float64))
    widths = np.diff(np.append(t, max(end, t[-1])))
    total = float(widths.sum())
    steps = [r["step"] for r in inside]

    def mean(x: np.ndarray) -> float:
        return float(np.dot(x, widths) / total) if total > 0 else float(x.mean())

    return {
        "available": True,
        "num_steps_seen": len(steps),
        "coverage": len(steps) / (steps[-1] - steps[0] + 1),
        "avg_held_blocks": mean(held),
        "peak_held_blocks": float(held.max()),
        "avg_slack_tokens": mean(slack),
        "peak_slack_tokens": float(slack.max()),
        "series": {"t_s": (t - start).tolist(), "held_blocks": held.tolist()},
    }


def padded_waste(workload: Workload, batch_size: int) -> dict[str, Any]:
    """The KV a padded static batch reserves and never fills, computed for ``workload``.

    Batches are consecutive groups of ``batch_size`` requests in submission order (static
    batching's FIFO batches when all arrive at once). A padded batch (HF ``generate``
    style) is a rectangle: every row left-padded to the batch's longest prompt and decoded
    for its longest output, so at its end it holds ``n x (max prompt + max output)`` token
    slots, of which ``sum(prompt + output)`` are real tokens. Waste of a batch = the
    difference; ``peak`` is the largest batch's (the memory the padding costs at once),
    ``total`` the sum over batches, ``fraction`` total waste / total slots."""
    reqs = workload.requests
    wastes, slots = [], []
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        rect = len(batch) * (max(r.prompt_len for r in batch) + max(r.output_len for r in batch))
        wastes.append(rect - sum(r.prompt_len + r.output_len for r in batch))
        slots.append(rect)
    return {
        "num_batches": len(wastes),
        "peak_waste_tokens": max(wastes),
        "total_waste_tokens": sum(wastes),
        "fraction": sum(wastes) / sum(slots),
    }


def occupancy(timeline: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Mean sequences per step, per step and over time (each step's batch holding until the
    next step starts), both also as a fraction of ``batch_size``."""
    if not timeline.get("t_s"):
        return {"available": False, "reason": timeline.get("source") or "no timeline"}
    per_step = Timeline(timeline["t_s"], timeline["running"]).mean()
    over_time = Timeline(timeline["t_s"], timeline["running"], step_function=True).mean()
    return {
        "available": True,
        "mean_per_step": per_step,
        "mean_over_time": over_time,
        "fraction_per_step": per_step / batch_size,
        "fraction_over_time": None if over_time is None else over_time / batch_size,
    }


def latency_percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in LATENCY_PERCENTILES}
    arr = np.percentile(np.asarray(values, dtype=np.float64), LATENCY_PERCENTILES)
    return {f"p{q}": float(v) for q, v in zip(LATENCY_PERCENTILES, arr)}
