"""The simulator's cost model: a step's time as a linear function of its plan's shape.

    t = c0 + c_prefill * prefill_tokens + c_decode * decode_seqs
           + c_context * context_tokens + c_copy * copied_blocks

per tensor-parallel size (one set of coefficients each: a TP group is a different machine
as far as step time goes). The shape is :func:`conveyor.profiling.plan_shape`, the same
counts the worker records per step under ``--profile`` (:class:`conveyor.profiling.StepRecorder`),
so a model fitted to a real run's records prices the plans the real scheduler forms in
the simulator. Why linear: a step's forward is matrix products whose work grows with the
tokens it runs (prefill and decode rows; their per-token costs differ once sampling and
the LM head are counted, which only sampled rows pay), attention whose work grows with the
context it reads, and a per-step floor (launch, inputs, Python); what it misses is shown by
the fit's residual and by the validation table of docs/benchmarks.md.

``sync_overhead_s`` is host time that is *not* hidden behind a step: paid once by every plan
formed with nothing in flight (the scheduler's schedule() and the transport, which a plan
formed ahead overlaps with the step before it). It is not in the worker's records, so
:func:`fit` leaves it 0 unless told; docs/architecture.md's tools paragraph says how the
simulator uses it.

The file (JSON) written by ``conveyor-sim calibrate``::

    {"version": 1, "features": [...], "sync_overhead_s": 0.0, "meta": {...},
     "tp": {"1": {"intercept_s": ..., "coef_s": {"prefill_tokens": ..., ...},
                  "num_steps": ..., "rel_rmse": ..., "source": "...", "num_blocks": 1234}}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.profiling import STEP_SHAPE_SERIES, STEP_TIME_SERIES, plan_shape

FEATURES: tuple[str, ...] = ("prefill_tokens", "decode_seqs", "context_tokens", "copied_blocks")
VERSION = 1


@dataclass
class StepCost:
    """One tensor-parallel size's coefficients (seconds, seconds per unit of each feature)."""

    intercept_s: float
    coef_s: dict[str, float]
    num_steps: int = 0  # records the fit used (0: written by hand)
    rel_rmse: float = 0.0  # root-mean-square residual over the mean step time
    source: str = ""
    num_blocks: int | None = None  # the calibrated server's KV pool (blocks), the simulator's default

    def __post_init__(self) -> None:
        unknown = set(self.coef_s) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {', '.join(FEATURES)}")
        self._vector = np.array([self.coef_s.get(f, 0.0) for f in FEATURES], np.float64)

    def time(self, shape: tuple[int, ...]) -> float:
        """Seconds of a step of this shape (never below zero: a fit may give a negative
        coefficient to a feature it hardly saw)."""
        return max(0.0, self.intercept_s + float(self._vector @ np.asarray(shape, np.float64)))

    def to_json(self) -> dict[str, Any]:
        return {
            "intercept_s": self.intercept_s,
            "coef_s": {f: self.coef_s.get(f, 0.0) for f in FEATURES},
            "num_steps": self.num_steps,
            "rel_rmse": self.rel_rmse,
            "source": self.source,
            "num_blocks": self.num_blocks,
        }


@dataclass
class CostModel:
    """Step costs by tensor-parallel size, and the host time a plan in sync pays."""

    by_tp: dict[int, StepCost]
    sync_overhead_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def step(self, tp: int) -> StepCost:
        if tp not in self.by_tp:
            raise KeyError(f"no cost model for tensor-parallel size {tp}; calibrated: {sorted(self.by_tp)}")
        return self.by_tp[tp]

    def plan_time(self, plan: Any, tp: int = 1) -> float:
        return self.step(tp).time(plan_shape(plan))

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "features": list(FEATURES),
            "sync_overhead_s": self.sync_overhead_s,
            "meta": self.meta,
            "tp": {str(tp): cost.to_json() for tp, cost in sorted(self.by_tp.items())},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        if data.get("version") != VERSION:
            raise ValueError(f"cost model version {data.get('version')!r}, expected {VERSION}")
        by_tp = {int(tp): StepCost(**c) for tp, c in data["tp"].items()}
        return cls(by_tp, float(data.get("sync_overhead_s", 0.0)), data.get("meta", {}))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


def fit(shapes: np.ndarray, times_s: np.ndarray, source: str = "") -> StepCost:
    """Least-squares coefficients of :data:`FEATURES` (columns of ``shapes``) and an intercept
    for step times ``times_s``. A feature that never varies (no swaps in the run) gets a zero
    coefficient (numpy's minimum-norm solution of the rank-deficient system), not an
    arbitrary one; the residual is reported relative to the mean step time."""
    shapes = np.asarray(shapes, np.float64)
    times_s = np.asarray(times_s, np.float64)
    if shapes.ndim != 2 or shapes.shape[1] != len(FEATURES) or len(shapes) != len(times_s):
        raise ValueError(f"shapes must be (steps, {len(FEATURES)}) and times (steps,)")
    if len(times_s) < len(FEATURES) + 1:
        raise ValueError(f"{len(times_s)} step records are too few to fit {len(FEATURES) + 1} coefficients")
    varies = shapes.std(axis=0) > 0
    design = np.column_stack([np.ones(len(times_s)), shapes[:, varies]])
    solution, *_ = np.linalg.lstsq(design, times_s, rcond=None)
    coef = np.zeros(len(FEATURES))
    coef[varies] = solution[1:]
    residual = times_s - design @ solution
    rel = float(np.sqrt(np.mean(residual**2)) / times_s.mean()) if times_s.mean() > 0 else 0.0
    return StepCost(float(solution[0]), dict(zip(FEATURES, coef.tolist())), len(times_s), rel, source)


def records_arrays(records: dict[str, list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(shapes, step times in seconds) from the worker's step records
    (:func:`conveyor.profiling.step_records` columns)."""
    shapes = np.column_stack([np.asarray(records[name], np.float64) for name in STEP_SHAPE_SERIES])
    return shapes, np.asarray(records[STEP_TIME_SERIES], np.float64) / 1e3
