"""Replays requests through the real scheduler in virtual time, the worker replaced by a cost model.

Each replica is an unmodified :class:`conveyor.scheduler.scheduler.Scheduler` built with the
:class:`~conveyor.runtime.config.SchedulerConfig` a server would use, its clock the virtual
clock. A :class:`Replica` reproduces the scheduler process's loop
(:mod:`conveyor.scheduler.main`) event by event:

- when nothing is in flight (an arrival wakes an idle server, a step ends with nothing
  planned ahead, the admission gate opens) it forms a plan; the step starts
  ``sync_overhead_s`` later (the host time a plan formed in sync cannot hide) and lasts the
  cost model's time for the plan;
- with overlap (the server's default) it then forms the next plan at once while the step
  runs, if the scheduler may plan ahead; that step starts when the one before it ends (the
  scheduler's own time hidden behind the step, as the worker finds the plan queued);
- when a step ends its result is applied (``update``) at that instant, outputs are stamped
  with it, and the loop goes on as above;
- requests arriving while a step runs are added to the scheduler at their arrival time
  (its queue order and waits see the true time) and first considered by the next plan
  formed, as the server takes them in while it waits for a result; requests arriving at
  the same instant are taken in together before any plan is formed.

The worker is a token counter (:class:`TokenCounter`): it follows each slot's known tokens
through the plans exactly as the real worker does and samples a token for every row whose
tokens are all computed, so the scheduler sees the same results a real worker would give
with EOS ignored: every request produces exactly its output length (``max_tokens``,
``ignore_eos``, as bin/bench runs it). What the model does not see: the frontend
(tokenizing, streaming), the host time of plans formed ahead when it exceeds the step, and
any variance of step times; docs/benchmarks.md measures how much that costs.

Invariants: virtual time never goes backwards in a replica; plans complete in the order
they were formed, each after the previous one's end; at most two are in flight.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.ipc.messages import AddRequest, SamplingParams, StepPlan, StepResult, TokenOutputs
from conveyor.runtime.config import SchedulerConfig
from conveyor.scheduler.scheduler import Scheduler
from conveyor_tools.sim.cost import StepCost

SAMPLED_TOKEN = 1  # the token the counter "samples": its value never matters with EOS ignored


@dataclass(frozen=True)
class SimRequest:
    """One request of a replay: when it arrives (s), its prompt and its exact output length."""

    arrival: float
    prompt_ids: list[int]
    output_len: int
    request_id: str = ""


@dataclass
class RequestTrace:
    """What happened to one request, in virtual seconds."""

    arrival: float
    output_len: int
    admitted: float | None = None  # formation of the first plan that sent it to the worker
    first_token: float | None = None
    finished: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.first_token is None or self.output_len < 2:
            return None
        return (self.finished - self.first_token) / (self.output_len - 1)

    @property
    def queueing(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrival


class TokenCounter:
    """The worker's bookkeeping of known tokens per slot, without a model: drops a plan's
    ``finished_slots``, takes in its new requests, and for each row (new requests first,
    then cached rows, the order a real worker answers in) samples a token when the row
    computes the last known one. Plans must be executed in the order they were formed."""

    def __init__(self) -> None:
        self.known: dict[int, int] = {}  # slot -> tokens known there

    def execute(self, plan: StepPlan) -> StepResult:
        known = self.known
        for slot in plan.finished_slots:
            known.pop(int(slot), None)
        slots: list[int] = []
        for new in plan.new_requests:
            known[new.slot] = len(new.token_ids)
            if new.num_computed_tokens + new.num_scheduled_tokens == known[new.slot]:
                slots.append(new.slot)
        cached = plan.cached_requests
        for slot, computed, scheduled in zip(
            np.asarray(cached.slots).tolist(),
            np.asarray(cached.num_computed_tokens).tolist(),
            np.asarray(cached.num_scheduled_tokens).tolist(),
        ):
            if computed + scheduled == known[slot]:
                slots.append(slot)
        for slot in slots:
            known[slot] += 1
        return StepResult(plan.step_id, np.array(slots, np.int32), np.full(len(slots), SAMPLED_TOKEN, np.int32))


@dataclass
class StepTrace:
    """One simulated step: its plan, when it was formed, started and ended (virtual s)."""

    plan: StepPlan
    formed: float
    start: float
    end: float
    num_seqs: int
    held_blocks: int


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Replica:
    """One scheduler + simulated worker; :meth:`add` requests, :meth:`advance` virtual time.

    ``step_time(plan)`` prices a plan in seconds (a :class:`~conveyor_tools.sim.cost.StepCost`
    bound to a tensor-parallel size, usually). ``outstanding`` counts requests added and not
    finished: what the frontend's least-outstanding routing compares.
    """

    config: SchedulerConfig
    step_time: Callable[[StepPlan], float]
    overlap: bool = True
    sync_overhead_s: float = 0.0
    record_steps: bool = True

    def __post_init__(self) -> None:
        self.clock = VirtualClock()
        self.scheduler = Scheduler(self.config, (), None, clock=self.clock)
        self.worker = TokenCounter()
        self.inflight: deque[StepTrace] = deque()
        self.steps: list[StepTrace] = []
        self.requests: dict[str, RequestTrace] = {}
        self.outstanding = 0
        self.outstanding_prompt_tokens = 0
        self._prompt_len: dict[str, int] = {}

    # ------------------------------------------------------------------ intake

    def add(self, requests: Iterable[SimRequest], now: float) -> None:
        """Requests arriving together at ``now`` (>= every event processed so far)."""
        self.clock.now = now
        for req in requests:
            trace = self.requests[req.request_id] = RequestTrace(req.arrival, req.output_len)
            msg = AddRequest(
                req.request_id,
                req.prompt_ids,
                SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True),
                now,
            )
            rejected = self.scheduler.add_request(msg)
            if rejected is not None:
                trace.error = rejected.error
                trace.finished = now
                continue
            self.outstanding += 1
            self.outstanding_prompt_tokens += len(req.prompt_ids)
            self._prompt_len[req.request_id] = len(req.prompt_ids)
        if not self.inflight:  # the loop was idle (or waiting on the gate): it plans now
            self._plan(now)

    # ------------------------------------------------------------------ time

    def next_event(self) -> float:
        """When this replica next does something on its own (a step ends, the gate opens); inf if never."""
        if self.inflight:
            return self.inflight[0].end
        if self.scheduler.has_work():
            wait = self.scheduler.seconds_until_ready()
            if wait is not None:
                return self.clock.now + wait + 1e-9
        return math.inf

    def advance(self, until: float) -> None:
        """Process every event at or before ``until``."""
        while True:
            t = self.next_event()
            if t > until or t == math.inf:
                return
            self.clock.now = t
            if self.inflight:
                self._complete(self.inflight.popleft())
            self._plan(t)
            if not self.inflight and self.next_event() <= t:
                raise RuntimeError(f"the simulated scheduler makes no progress at t={t}")

    def _plan(self, now: float) -> None:
        """The scheduler loop's planning at ``now``: a plan in sync if none is in flight, then one ahead."""
        sched = self.scheduler
        if not self.inflight:
            self._form(now, now + self.sync_overhead_s)
        if self.inflight and self.overlap and sched.can_plan_ahead:
            self._form(now, self.inflight[-1].end)

    def _form(self, now: float, start: float) -> None:
        plan = self.scheduler.schedule()
        self._outputs_timed_out(self.scheduler.take_outputs(), now)
        if plan is None:
            return
        for new in plan.new_requests:
            trace = self.requests[new.request_id]
            if trace.admitted is None:
                trace.admitted = now
        num_seqs = len(plan.new_requests) + len(plan.cached_requests)
        step = StepTrace(plan, now, start, start + self.step_time(plan), num_seqs, self.scheduler.state.kv.gpu.num_held)
        self.inflight.append(step)
        if self.record_steps:
            self.steps.append(step)

    def _complete(self, step: StepTrace) -> None:
        result = self.worker.execute(step.plan)
        out: TokenOutputs = self.scheduler.update(step.plan, result)
        now = step.end
        for rid in out.request_ids:
            self._token(rid, now)
        for o in out.outputs:
            if o.new_token_ids:
                self._token(o.request_id, now)
            if o.finish_reason is not None:
                self._finish(o.request_id, now, o.error)

    def _token(self, rid: str, now: float) -> None:
        trace = self.requests[rid]
        if trace.first_token is None:
            trace.first_token = now

    def _finish(self, rid: str, now: float, error: str | None) -> None:
        trace = self.requests[rid]
        trace.finished = now
        trace.error = error
        self.outstanding -= 1
        self.outstanding_prompt_tokens -= self._prompt_len.pop(rid)

    def _outputs_timed_out(self, outputs: list, now: float) -> None:
        for o in outputs:
            self._finish(o.request_id, now, o.error)


@dataclass
class SimResult:
    """A replay's outcome: every request's trace and every replica's steps."""

    requests: list[RequestTrace]
    replicas: list[Replica]
    num_blocks: int
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.requests if r.error is None and r.finished is not None]
        start = min(r.arrival for r in self.requests)
        end = max((r.finished for r in self.requests if r.finished is not None), default=start)
        wall = max(end - start, 1e-12)
        output_tokens = sum(r.output_len for r in done)
        steps = [s for rep in self.replicas for s in rep.steps]
        busy = sum(s.end - s.start for s in steps)
        stats = [rep.scheduler.stats() for rep in self.replicas]
        return {
            "num_requests": len(self.requests),
            "num_completed": len(done),
            "num_failed": len(self.requests) - len(done),
            "wall_s": wall,
            "output_tok_s": output_tokens / wall,
            "req_s": len(done) / wall,
            "ttft_s": percentiles([r.ttft for r in done]),
            "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
            "e2e_s": percentiles([r.e2e for r in done]),
            "queueing_s": percentiles([r.queueing for r in done]),
            "num_steps": len(steps),
            "num_preemptions": sum(s["num_preemptions"] for s in stats),
            # time-weighted over the steps: sequences per step, and KV blocks held / pool
            "mean_batch_seqs": _weighted([s.num_seqs for s in steps], [s.end - s.start for s in steps]),
            "mean_kv_occupancy": _weighted(
                [s.held_blocks / self.num_blocks for s in steps], [s.end - s.start for s in steps]
            ),
            "worker_busy_fraction": busy / (wall * len(self.replicas)),
        }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(values))}


def _weighted(values: list[float], weights: list[float]) -> float | None:
    total = sum(weights)
    return float(np.dot(values, weights) / total) if total > 0 else None


def simulate(
    requests: list[SimRequest],
    config: SchedulerConfig,
    step_time: StepCost | Callable[[StepPlan], float],
    *,
    replicas: int = 1,
    overlap: bool = True,
    sync_overhead_s: float = 0.0,
    record_steps: bool = True,
) -> SimResult:
    """Replay ``requests`` (any order; ids default to their index) on ``replicas``
    data-parallel replicas, each a scheduler with ``config`` and steps priced by
    ``step_time``: a :class:`StepCost` prices each replica's steps with a pricer of its own
    (a server's warm-up is its own), any other callable is shared as it is. Routing is the
    frontend's (:mod:`conveyor.frontend.replicas`): each request goes to the replica with the fewest
    outstanding requests, ties broken by their prompt tokens, then by the replica picked least
    recently."""

    def pricer() -> Callable[[StepPlan], float]:
        return step_time.pricer() if isinstance(step_time, StepCost) else step_time

    reps = [Replica(config, pricer(), overlap, sync_overhead_s, record_steps) for _ in range(replicas)]
    named = [
        r if r.request_id else SimRequest(r.arrival, r.prompt_ids, r.output_len, str(i)) for i, r in enumerate(requests)
    ]
    named.sort(key=lambda r: r.arrival)
    last_pick = [-1] * replicas  # as the frontend's: ties go to the lowest index
    picks = 0
    i = 0
    while i < len(named):
        now = named[i].arrival
        batch: dict[int, list[SimRequest]] = {}
        for rep in reps:
            rep.advance(now)
        while i < len(named) and named[i].arrival == now:
            req = named[i]
            k = min(range(replicas), key=lambda j: (
                reps[j].outstanding + len(batch.get(j, [])),
                reps[j].outstanding_prompt_tokens + sum(len(r.prompt_ids) for r in batch.get(j, [])),
                last_pick[j]))  # fmt: skip
            batch.setdefault(k, []).append(req)
            last_pick[k] = picks
            picks += 1
            i += 1
        for k, reqs in batch.items():
            reps[k].add(reqs, now)
    for rep in reps:
        rep.advance(math.inf)
        if rep.scheduler.has_work() or rep.inflight:
            raise RuntimeError("the simulated scheduler stopped with live requests and nothing to wait for")
    traces = [rep.requests[r.request_id] for r in named for rep in reps if r.request_id in rep.requests]
    return SimResult(traces, reps, config.num_blocks)
