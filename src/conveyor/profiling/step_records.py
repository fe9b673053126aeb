"""The worker's per-step records (behind --profile): each step's shape and busy time as
series (:class:`StepRecorder`), and the columns read back from a profile reply
(:func:`step_records`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from conveyor.profiling.recorder import NS_PER_MS, Profiler

# The worker's per-step record (behind --profile): one sample of each series per step, all
# stamped with the same timestamp (the step's end), so sample i of every series is one step.
# The shape is what a step's cost depends on (conveyor_tools.sim fits a cost model to it).
STEP_SHAPE_SERIES: tuple[str, ...] = (
    "step_prefill_tokens",  # tokens of requests with more than one token scheduled
    "step_decode_seqs",  # requests with exactly one token scheduled
    "step_context_tokens",  # sum over the plan of (computed + scheduled): attention's reach
    "step_copied_blocks",  # swap-outs + swap-ins + block copies
    "step_prefill_attention",  # sum over those requests of scheduled x (computed + scheduled): query-key pairs
    "step_decode_classes",  # distinct lengths among the decode rows, at a ratio of LENGTH_CLASS_RATIO
)
# A batched attention pads the rows of a group to its longest; the CPU backend keeps a group's
# padding within 1.25x (worker/attention/torch_batched.py), so rows whose lengths differ by
# more run as separate groups: per-group work a sum of lengths cannot show.
LENGTH_CLASS_RATIO = 1.25
STEP_TIME_SERIES = "step_time"  # ms the worker was busy with the step (StepRecorder says which)
STEP_SERIES: tuple[str, ...] = (*STEP_SHAPE_SERIES, STEP_TIME_SERIES)
STEP_CAPACITY = 1 << 16


def plan_shape(plan: Any) -> tuple[int, int, int, int, int, int]:
    """A :class:`~conveyor.ipc.messages.StepPlan`'s shape, in :data:`STEP_SHAPE_SERIES` order.

    The same counts as the scheduler's iteration log (``prefill_tokens``, ``decode_tokens``,
    ``context_tokens``, swap blocks), computed from the plan alone so the worker can record
    them beside its own step time and a simulator can price a plan it never ran; and the
    prefill's attention pairs, the term quadratic in a prompt's length (each of its new
    tokens scores every key up to the chunk's end), and the decode rows' length classes
    (:data:`LENGTH_CLASS_RATIO`), which a sum of lengths cannot show either."""
    scheduled = _per_request(plan, "num_scheduled_tokens")
    computed = _per_request(plan, "num_computed_tokens")
    multi = scheduled > 1
    copies = len(plan.swap_out) + len(plan.swap_in) + len(plan.copy_blocks)
    reach = computed + scheduled
    pairs = int((scheduled[multi] * reach[multi]).sum())
    decode = reach[~multi]
    # class k holds lengths in [ratio^k, ratio^(k+1)); bincount over the few k is cheaper than a sort
    classes = int(
        np.count_nonzero(np.bincount((np.log(np.maximum(decode, 1)) / math.log(LENGTH_CLASS_RATIO)).astype(np.int64)))
    )
    return int(scheduled[multi].sum()), int((~multi).sum()), int(reach.sum()), copies, pairs, classes


def _per_request(plan: Any, name: str) -> np.ndarray:
    """Field ``name`` of every request in ``plan``: new requests first, then cached ones."""
    new = plan.new_requests
    cached = np.asarray(getattr(plan.cached_requests, name), np.int64)
    return np.concatenate([np.fromiter((getattr(r, name) for r in new), np.int64, len(new)), cached])


class StepRecorder:
    """Records each step's :func:`plan_shape` and busy time into the :data:`STEP_SERIES`.

    A step's busy time runs from when the worker read its plan, or when it finished the
    step before (whichever is later: a pipelined step is launched while the previous one
    still runs), to when its result was sent. Steps back to back thus tile the worker's
    busy time without overlap, which is what a simulator that runs one step after another
    must reproduce. A disabled profiler records nothing and ``enabled`` is False, so the
    caller skips computing the shape."""

    def __init__(self, prof: Profiler) -> None:
        self.enabled = prof.enabled
        self._series = [prof.series(name, "count", capacity=STEP_CAPACITY) for name in STEP_SHAPE_SERIES]
        self._series.append(prof.series(STEP_TIME_SERIES, "ms", capacity=STEP_CAPACITY))
        self._last_end_ns = 0

    def record(self, shape: tuple[int, ...], received_ns: int, end_ns: int) -> None:
        start = max(received_ns, self._last_end_ns)
        self._last_end_ns = end_ns
        for series, value in zip(self._series, (*shape, (end_ns - start) / NS_PER_MS)):
            series.add(value, end_ns)


def step_records(
    processes: list[dict[str, Any]], since_ns: int = 0, until_ns: int | None = None
) -> dict[str, list[float]]:
    """The worker's per-step records in a profile reply's ``processes`` (asked for with
    ``series=STEP_SERIES``), as columns by series name, steps ending in ``[since_ns, until_ns]``;
    empty columns when the worker recorded none (--no-profile). With data-parallel replicas,
    every worker's steps (``worker``, ``worker.1`` ...) are concatenated."""
    out: dict[str, list[float]] = {name: [] for name in STEP_SERIES}
    for proc in processes:
        if proc["process"].split(".")[0] != "worker":
            continue
        series = proc.get("series", {})
        if any(name not in series for name in STEP_SERIES):
            continue
        ts = np.asarray(series[STEP_TIME_SERIES]["ts_ns"], np.int64)
        keep = (ts >= since_ns) & (ts <= (until_ns if until_ns is not None else ts.max(initial=0)))
        for name in STEP_SERIES:
            out[name].extend(np.asarray(series[name]["values"], np.float64)[keep].tolist())
    return out
