"""The simulator's cost model: a step's time as a linear function of its plan's shape.

    t = c0 + c_prefill * prefill_tokens + c_decode * decode_seqs
           + c_context * context_tokens + c_copy * copied_blocks + c_pairs * prefill_attention
           + c_classes * decode_classes + c_peak * peak_tokens + c_experts * expert_groups

per tensor-parallel size (one set of coefficients each: a TP group is a different machine
as far as step time goes). The shape is :func:`conveyor.profiling.plan_shape`, the same
counts the worker records per step under ``--profile`` (:class:`conveyor.profiling.StepRecorder`),
so a model fitted to a real run's records prices the plans the real scheduler forms in
the simulator. Why linear: a step's forward is matrix products whose work grows with the
tokens it runs (prefill and decode rows; their per-token costs differ once sampling and
the LM head are counted, which only sampled rows pay), attention whose work grows with the
context it reads (and, for a prompt, with its query-key pairs: quadratic in its length;
and on a CPU with the groups its rows are padded in, one per class of similar lengths),
and a per-step floor (launch, inputs, Python); what it misses is shown by the fit's
residual and by the validation table of docs/benchmarks.md. One term is not the plan's own:
``peak_tokens``, a step's tokens when it runs more than any step before it on the server
(else 0). The first step at a new size allocates and touches its activations and scratch
for the first time, on a CPU up to twice a step's time; it is what makes a run's first wave
slower than the next, which every request's TTFT after it carries. A run's steps are priced
in order (:meth:`StepCost.pricer`), each server (replica) from zero.

``expert_groups`` prices a mixture-of-experts model's expert GEMMs: a step runs one GEMM pair
per expert its tokens picked, each reading that expert's weights, so beside the per-token
work (in the token terms) a step pays per active expert. Which experts a step picks is the
model's, not the plan's; the term is the number a step of ``N`` tokens touches on average
under uniform routing over ``E`` experts, ``k`` per token: ``E * (1 - (1 - k/E)^N)`` (one at
N = 1 decode row per expert picked, all ``E`` for a large prefill), for the ``(E, k)`` the
cost model was calibrated with (``experts``; None for a dense model: the term is 0).

How :func:`fit` fits: every coefficient is non-negative (no feature makes a step cheaper;
a free least-squares fit gives a negative one to a feature that hardly varied, which then
extrapolates to nonsense), steps whose time is far off the first fit's prediction (the
first step's warm-up, a step descheduled by another process) are left out of the second,
each calibration run is fitted at its own level (a factor on all its steps, re-estimated
between passes: another process's load slows a whole run, and a feature that tells runs
apart must not take the difference between their loads for its cost), and the coefficients
are then scaled so that the calibration steps' predicted total is their measured total: the
left-out time is real and the runs being predicted pay it too, spread over their steps as
over the calibration's.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.profiling import STEP_SHAPE_SERIES, STEP_TIME_SERIES, plan_shape

PLAN_FEATURES: tuple[str, ...] = (
    "prefill_tokens", "decode_seqs", "context_tokens", "copied_blocks", "prefill_attention", "decode_classes",
)  # fmt: skip
FEATURES: tuple[str, ...] = (*PLAN_FEATURES, "peak_tokens", "expert_groups")
VERSION = 1  # a file without a feature (written before it existed) prices it at 0
TRIM_DEVIATIONS = 4.0  # a step this many robust deviations off the first fit is left out of the next
MAX_LEVEL_PASSES = 50  # fits alternating with the runs' levels (they settle within 1e-4 in about 10)


@dataclass
class StepCost:
    """One tensor-parallel size's coefficients (seconds, seconds per unit of each feature)."""

    intercept_s: float
    coef_s: dict[str, float]
    num_steps: int = 0  # records the fit used (0: written by hand)
    num_trimmed: int = 0  # of which left out of the second pass as outliers
    rel_rmse: float = 0.0  # root-mean-square residual over the mean step time
    source: str = ""
    num_blocks: int | None = None  # the calibrated server's KV pool (blocks), the simulator's default
    experts: tuple[int, int] | None = None  # a MoE model's (num_experts, top_k): the expert_groups term

    def __post_init__(self) -> None:
        if self.experts is not None:
            self.experts = (int(self.experts[0]), int(self.experts[1]))
        unknown = set(self.coef_s) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {', '.join(FEATURES)}")
        self._vector = np.array([self.coef_s.get(f, 0.0) for f in FEATURES], np.float64)

    def time(self, shape: tuple[int, ...], peak_tokens: int = 0) -> float:
        """Seconds of a step of plan shape ``shape`` (:func:`conveyor.profiling.plan_shape`)
        and ``peak_tokens`` (never below zero: a hand-written coefficient may be negative)."""
        groups = float(expert_groups(np.asarray([shape[0] + shape[1]], np.float64), self.experts)[0])
        x = np.asarray((*shape, peak_tokens, groups), np.float64)
        return max(0.0, self.intercept_s + float(self._vector @ x))

    def pricer(self) -> Callable[[Any], float]:
        """Seconds of each plan of one server, called in the order its steps run (the
        simulator's order of forming them): tracks the most tokens a step has run so far."""
        peak = 0

        def price(plan: Any) -> float:
            nonlocal peak
            shape = plan_shape(plan)
            tokens = shape[0] + shape[1]
            new = tokens if tokens > peak else 0
            peak = max(peak, tokens)
            return self.time(shape, new)

        return price

    def to_json(self) -> dict[str, Any]:
        return {
            "intercept_s": self.intercept_s,
            "coef_s": {f: self.coef_s.get(f, 0.0) for f in FEATURES},
            "num_steps": self.num_steps,
            "num_trimmed": self.num_trimmed,
            "rel_rmse": self.rel_rmse,
            "source": self.source,
            "num_blocks": self.num_blocks,
            "experts": None if self.experts is None else list(self.experts),
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


def fit(
    shapes: np.ndarray,
    times_s: np.ndarray,
    source: str = "",
    runs: np.ndarray | None = None,
    experts: tuple[int, int] | None = None,
) -> StepCost:
    """Non-negative coefficients of :data:`FEATURES` (columns of ``shapes``) and an intercept
    for step times ``times_s``, with outliers left out, each run (``runs``: a label per step)
    at its own level, and scaled to the measured total (the module docstring says why). A
    feature that never varies (no swaps in the run) gets a zero coefficient, not an arbitrary
    one; the residual is reported relative to the mean step time, over every step.
    ``experts``: the ``(E, k)`` the ``expert_groups`` column was computed for, kept for pricing."""
    shapes = np.asarray(shapes, np.float64)
    times_s = np.asarray(times_s, np.float64)
    if shapes.ndim != 2 or shapes.shape[1] != len(FEATURES) or len(shapes) != len(times_s):
        raise ValueError(f"shapes must be (steps, {len(FEATURES)}) and times (steps,)")
    if len(times_s) < len(FEATURES) + 1:
        raise ValueError(f"{len(times_s)} step records are too few to fit {len(FEATURES) + 1} coefficients")
    run = np.unique(np.zeros(len(times_s)) if runs is None else np.asarray(runs), return_inverse=True)[1].ravel()
    varies = shapes.std(axis=0) > 0
    design = np.column_stack([np.ones(len(times_s)), shapes[:, varies]])
    solution, level = _leveled_fit(design, times_s, run, np.ones(len(times_s), bool))
    rel = times_s / np.maximum(level * (design @ solution), 1e-12) - 1.0
    spread = 1.4826 * np.median(np.abs(rel - np.median(rel)))  # the deviation a normal's MAD estimates
    keep = np.abs(rel - np.median(rel)) <= TRIM_DEVIATIONS * spread if spread > 0 else np.ones(len(rel), bool)
    solution, _ = _leveled_fit(design, times_s, run, keep)
    predicted = design @ solution
    if predicted.sum() > 0:
        solution *= times_s.sum() / predicted.sum()
    coef = np.zeros(len(FEATURES))
    coef[varies] = solution[1:]
    residual = times_s - design @ solution
    rel_rmse = float(np.sqrt(np.mean(residual**2)) / times_s.mean()) if times_s.mean() > 0 else 0.0
    return StepCost(
        float(solution[0]), dict(zip(FEATURES, coef.tolist())), num_steps=len(times_s), num_trimmed=int((~keep).sum()),
        rel_rmse=rel_rmse, source=source, experts=experts,
    )  # fmt: skip


def _leveled_fit(
    design: np.ndarray, times_s: np.ndarray, run: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients for ``times ~ level[run] * (design @ x)`` over the ``keep`` steps, x >= 0,
    alternating the fit with each run's level (its measured over its modelled time) until the
    levels settle; returns x and each step's level."""
    level = np.ones(len(times_s))
    for _ in range(MAX_LEVEL_PASSES):
        solution = nonnegative_lstsq(design[keep] * level[keep, None], times_s[keep])
        modelled = np.bincount(run[keep], (design @ solution)[keep], minlength=run.max() + 1)
        new = (np.bincount(run[keep], times_s[keep], minlength=run.max() + 1) / np.maximum(modelled, 1e-12))[run]
        settled = np.allclose(new, level, rtol=1e-4)
        level = new
        if settled:
            break
    return solution, level


def nonnegative_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||design @ x - target|| over x >= 0, exactly, for the few columns of a cost
    model: the optimum is the least-squares solution on its own support, so it is the best
    of the subsets' solutions that come out non-negative (2^columns small solves; columns
    are scaled to unit norm first, so features counted in millions and in ones condition
    alike)."""
    cols = design.shape[1]
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    scaled = design / norms
    best, best_err = np.zeros(cols), float(np.sum(target**2))
    for mask in range(1, 1 << cols):
        support = [c for c in range(cols) if mask >> c & 1]
        x, *_ = np.linalg.lstsq(scaled[:, support], target, rcond=None)
        if (x < 0).any():
            continue
        err = float(np.sum((scaled[:, support] @ x - target) ** 2))
        if err < best_err:
            best, best_err = np.zeros(cols), err
            best[support] = x
    return best / norms


def records_arrays(
    records: dict[str, list[float]], experts: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(features, step times in seconds) of one server's step records
    (:func:`conveyor.profiling.step_records` columns, in step order): the plan shapes, their
    ``peak_tokens`` and ``expert_groups`` (for a MoE model's ``experts``), the columns
    :func:`fit` takes."""
    shapes = np.column_stack([np.asarray(records[name], np.float64) for name in STEP_SHAPE_SERIES])
    groups = expert_groups(shapes[:, 0] + shapes[:, 1], experts)
    times = np.asarray(records[STEP_TIME_SERIES], np.float64) / 1e3
    return np.column_stack([shapes, peak_tokens(shapes), groups]), times


def expert_groups(tokens: np.ndarray, experts: tuple[int, int] | None) -> np.ndarray:
    """The experts a step of ``tokens`` tokens touches on average, ``E * (1 - (1 - k/E)^N)``
    for ``experts`` ``(E, k)`` (module docstring); zeros for a dense model (None)."""
    if experts is None:
        return np.zeros(len(tokens))
    num, top_k = experts
    return num * (1.0 - (1.0 - top_k / num) ** np.asarray(tokens, np.float64))


def peak_tokens(shapes: np.ndarray) -> np.ndarray:
    """Each step's tokens (prefill tokens + decode rows) where it runs more than every step
    before it, else 0: :meth:`StepCost.pricer`'s term over recorded steps."""
    tokens = shapes[:, 0] + shapes[:, 1]
    before = np.maximum.accumulate(np.concatenate([[0.0], tokens[:-1]]))
    return np.where(tokens > before, tokens, 0.0)
