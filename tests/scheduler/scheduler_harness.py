"""Drives a Scheduler against a FakeWorker the way the scheduler process loop does,
recording every output and checking the invariants around every call.

With ``overlap`` it plans ahead like the process loop does with overlap on: each
:meth:`Harness.step` applies the oldest plan in flight after forming the next one, so a plan
usually stays in flight between steps (arrivals and aborts then land while it runs).

Time is a :class:`FakeClock` the test advances, so waits, aging and timeouts are exact.
Plans name requests by slot; the harness follows which request holds each slot, plan by
plan as the worker does (drops, then new requests), so that tests can read a plan by
request id (:meth:`Harness.finished_ids`, :meth:`Harness.cached_ids`).
A request id can be submitted again once its previous submission finished (a
continuation, or plain reuse); each submission is recorded under its own *key*: the id
for the first, ``"<id>#<n>"`` for the n-th resubmission.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from conveyor.ipc.messages import (
    AddRequest,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
    sequence_id,
)
from conveyor.runtime.config import SchedulerConfig
from conveyor.scheduler.scheduler import Scheduler
from tests import plans
from tests.scheduler.fake_worker import FakeWorker

EOS = 0


def make_prompt(request_id: str, n: int) -> list[int]:
    """A prompt of ``n`` tokens in 1..999 (never the EOS id 0)."""
    seed = sum(map(ord, request_id))
    return [1 + (seed * 31 + 7 * i) % 999 for i in range(n)]


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Harness:
    config: SchedulerConfig
    worker_kwargs: dict = field(default_factory=dict)
    vocab_size: int | None = 1000
    overlap: bool = False

    def __post_init__(self) -> None:
        self.clock = FakeClock()
        self.scheduler = Scheduler(self.config, [EOS], self.vocab_size, clock=self.clock)
        self.worker = FakeWorker(
            self.config.block_size,
            self.config.num_blocks,
            eos_token_id=EOS,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            num_cpu_blocks=self.config.num_cpu_blocks,
            **self.worker_kwargs,
        )
        # Per submission key:
        self.rid_of: dict[str, str] = {}
        self.prompts: dict[str, list[int]] = {}
        self.sampling: dict[str, SamplingParams] = {}
        self.priority: dict[str, int] = {}
        self.arrival: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, RequestOutput] = {}
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.live_key: dict[str, str] = {}  # request id -> key of its live submission
        self.submissions: dict[str, int] = {}  # request id -> times submitted
        self.groups: dict[str, list[str]] = {}  # parallel-sampling request id -> its sequence ids
        self.plans: list[StepPlan] = []
        self.inflight: deque[StepPlan] = deque()
        # step id -> {request id: key of the submission the plan scheduled}
        self.keys_in_plan: dict[int, dict[str, str]] = {}
        # slot -> request id holding it, as of the last plan formed (drops, then new requests)
        self.slot_owner: dict[int, str] = {}
        # step id -> request ids of the plan's finished_slots / cached rows, in order
        self._finished_ids: dict[int, list[str]] = {}
        self._cached_ids: dict[int, list[str]] = {}

    # -------------------------------------------------------------- intake

    def add(
        self,
        request_id: str,
        prompt_len: int = 4,
        max_tokens: int = 4,
        prompt: list[int] | None = None,
        priority: int = 0,
        lora: str | None = None,
        **sampling,
    ) -> RequestOutput | None:
        prompt = make_prompt(request_id, prompt_len) if prompt is None else prompt
        msg = AddRequest(
            request_id, prompt, SamplingParams(max_tokens=max_tokens, **sampling), 1000.0, priority, lora=lora
        )
        rejected = self.scheduler.add_request(msg)
        if rejected is None:
            num_seqs = msg.sampling.n
            # A parallel-sampling request: each sequence is a submission of its own.
            ids = [request_id] if num_seqs == 1 else [sequence_id(request_id, i) for i in range(num_seqs)]
            if num_seqs > 1:
                self.groups[request_id] = ids
            for rid in ids:
                n = self.submissions.get(rid, 0)
                key = rid if n == 0 else f"{rid}#{n}"
                self.submissions[rid] = n + 1
                self.rid_of[key] = rid
                self.prompts[key] = list(prompt)
                self.sampling[key] = msg.sampling
                self.priority[key] = priority
                self.arrival[key] = self.clock.now
                self.live_key[rid] = key
        self.check()
        return rejected

    def live_ids(self, request_id: str) -> set[str]:
        """The live ids ``request_id`` names: its live sequences for a parallel-sampling request."""
        if request_id not in self.groups:
            return {request_id} if request_id in self.live_key else set()
        # (a sequence id reused by a continuation is a request of its own)
        return {rid for rid in self.groups[request_id] if self.live_key.get(rid) == rid}

    def context(self, key: str) -> list[int]:
        """Prompt + outputs of a finished submission: what a continuation extends."""
        return self.prompts[key] + self.tokens.get(key, [])

    def abort(self, *request_ids: str) -> list[RequestOutput]:
        outs = self.scheduler.abort(list(request_ids))
        self.record(outs)
        self.check()
        return outs

    # -------------------------------------------------------------- stepping

    def schedule(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        self.record(self.scheduler.take_outputs())
        self.check()
        if plan is not None:
            self._follow_slots(plan)
            self.plans.append(plan)
            self.inflight.append(plan)
            self.keys_in_plan[plan.step_id] = {rid: self.live_key[rid] for rid in self.scheduled_in(plan)}
        return plan

    def _follow_slots(self, plan: StepPlan) -> None:
        owner = self.slot_owner
        for slot in plan.finished_slots:
            assert slot in owner, f"step {plan.step_id} drops slot {slot}, which no request was given"
        self._finished_ids[plan.step_id] = [owner.pop(slot) for slot in plan.finished_slots]
        for new in plan.new_requests:
            assert new.slot not in owner, f"{new.request_id} given slot {new.slot}, held by {owner[new.slot]}"
            owner[new.slot] = new.request_id
        self._cached_ids[plan.step_id] = [owner[slot] for slot in plan.cached_requests.slots]

    def finished_ids(self, plan: StepPlan) -> list[str]:
        """The ids of the requests whose slots ``plan`` drops, in its order."""
        return self._finished_ids[plan.step_id]

    def cached_ids(self, plan: StepPlan) -> list[str]:
        """The ids of the requests of ``plan``'s cached rows, in row order."""
        return self._cached_ids[plan.step_id]

    def cached_rows(self, plan: StepPlan) -> dict[str, plans.CachedRow]:
        """``plan``'s cached rows by request id."""
        return dict(zip(self.cached_ids(plan), plans.rows(plan.cached_requests)))

    def plan_ahead(self) -> StepPlan | None:
        """In overlap mode, form the next plan while one is in flight (if the scheduler may)."""
        if self.overlap and self.scheduler.can_plan_ahead:
            return self.schedule()
        return None

    def finish_step(self, plan: StepPlan | None = None, result: StepResult | None = None) -> list[RequestOutput]:
        """Run and apply the oldest plan in flight (``plan``, if given, must be it)."""
        oldest = self.inflight[0]
        assert plan is None or plan is oldest, "plans finish in the order they were formed"
        if result is None:
            result = self.worker.execute(oldest)
        outs = plans.expanded(self.scheduler.update(oldest, result))
        self.inflight.popleft()
        self.record(outs)
        self.check()
        return outs

    def step(self) -> StepPlan | None:
        """One iteration: plan (ahead, in overlap mode) and apply the oldest plan; the plan
        applied, or None when nothing was in flight and nothing could be planned."""
        if not self.inflight and self.schedule() is None:
            return None
        self.plan_ahead()
        plan = self.inflight[0]
        self.finish_step(plan)
        return plan

    def live_in_plan(self, plan: StepPlan) -> set[str]:
        """Ids the plan scheduled whose submission is still live (not ended since)."""
        return {rid for rid, key in self.keys_in_plan[plan.step_id].items() if self.live_key.get(rid) == key}

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is live (advancing the clock when only the admission gate
        or a queue timeout can make progress); the number of steps taken."""
        steps = 0
        while self.scheduler.has_work() or self.inflight:
            if self.step() is None and self.scheduler.has_work():  # (a queue timeout may have ended the last one)
                wait = self.scheduler.seconds_until_ready()
                assert wait is not None, (
                    "live requests but no plan and nothing to wait for: "
                    + "; ".join(
                        f"{r.request_id} {r.status.name} computed={r.num_computed_tokens}/{r.num_tokens} "
                        f"blocks={r.block_ids} cpu={r.cpu_blocks}"
                        for r in list(self.scheduler.state.table.running) + list(self.scheduler.state.queue)
                    )
                    + f" pool available={self.scheduler.state.kv.gpu.num_available}"
                )
                self.clock.advance(wait + 1e-6)
            steps += 1
            assert steps <= max_steps, "no progress"
        assert self.schedule() is None
        self.check_idle()
        return steps

    # -------------------------------------------------------------- bookkeeping

    def record(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            key = self.live_key.get(o.request_id)
            if key is None:  # rejected at arrival: never had a key
                continue
            assert key not in self.final, f"{key} got output after finishing"
            self.outputs.setdefault(key, []).append(o)
            self.tokens.setdefault(key, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.final[key] = o
                del self.live_key[o.request_id]

    def check(self) -> None:
        self.scheduler.check_invariants()
        pool = self.scheduler.state.kv.gpu
        assert pool.num_free + pool.num_cached + pool.num_held == pool.total

    def check_idle(self) -> None:
        pool = self.scheduler.state.kv.gpu
        assert pool.num_held == 0, f"{pool.num_held} blocks still held"
        cpu = self.scheduler.state.kv.swap.pool
        assert cpu is None or cpu.num_held == 0, f"{cpu.num_held} CPU blocks still held"
        assert self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0

    def expected_tokens(self, key: str, n: int) -> list[int]:
        return self.worker.expected_outputs(self.rid_of[key], len(self.prompts[key]), n)

    def alone(self, key: str) -> tuple[list[int], str]:
        """The outputs and finish reason of a submission run alone to its natural end."""
        sp = self.sampling[key]
        rid = self.rid_of[key]
        plen = len(self.prompts[key])
        out: list[int] = []
        while True:
            t = self.worker.token_for(rid, plen + len(out))
            out.append(t)
            if (t == EOS and not sp.ignore_eos) or t in sp.stop_token_ids:
                return out, "stop"
            if len(out) >= sp.max_tokens or plen + len(out) >= self.config.max_model_len:
                return out, "length"

    def check_outcomes(self) -> None:
        """Every accepted submission finished once, with the tokens it would have had alone
        (a prefix of them when aborted or failed)."""
        assert set(self.final) >= set(self.prompts)
        for key in self.prompts:
            expected, reason = self.alone(key)
            got, final = self.tokens.get(key, []), self.final[key]
            if final.finish_reason in ("abort", "error"):
                assert got == expected[: len(got)], key
            else:
                assert (got, final.finish_reason) == (expected, reason), key

    def chunks_beside_decodes(self, prompt_len: int, decode_tokens: int) -> list[int]:
        """Start two short requests ``d0``/``d1`` decoding (``decode_tokens`` each), then add
        ``long`` of ``prompt_len`` tokens and step until it has its first token: every step
        must plan one token of each decode (a chunked prefill never starves them) within the
        token budget. Returns the long prompt's chunk per step."""
        self.add("d0", prompt_len=2, max_tokens=decode_tokens)
        self.add("d1", prompt_len=2, max_tokens=decode_tokens)
        self.step()  # both prefilled, decoding from now on
        self.add("long", prompt_len=prompt_len, max_tokens=2)
        chunks = []
        while "long" not in self.tokens:
            sched = self.scheduled_in(self.step())
            assert sched["d0"] == 1 and sched["d1"] == 1, "a decode was starved by the prefill"
            assert sum(sched.values()) <= self.config.max_num_batched_tokens
            chunks.append(sched["long"])
        return chunks

    def scheduled_in(self, plan: StepPlan) -> dict[str, int]:
        out = {r.request_id: r.num_scheduled_tokens for r in plan.new_requests}
        out.update(zip(self.cached_ids(plan), plan.cached_requests.num_scheduled_tokens))
        return out
