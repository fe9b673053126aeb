"""Drives a Scheduler against a FakeWorker the way the scheduler process loop does,
recording every output and checking the invariants around every call."""

from __future__ import annotations

from dataclasses import dataclass, field

from fake_worker import FakeWorker

from conveyor.common.config import SchedulerConfig
from conveyor.common.messages import AddRequest, RequestOutput, SamplingParams, StepPlan, StepResult
from conveyor.scheduler.scheduler import Scheduler

EOS = 0


def make_prompt(request_id: str, n: int) -> list[int]:
    """A prompt of ``n`` tokens in 1..999 (never the EOS id 0)."""
    seed = sum(map(ord, request_id))
    return [1 + (seed * 31 + 7 * i) % 999 for i in range(n)]


@dataclass
class Harness:
    config: SchedulerConfig
    worker_kwargs: dict = field(default_factory=dict)
    vocab_size: int | None = 1000

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(self.config, [EOS], self.vocab_size)
        self.worker = FakeWorker(
            self.config.block_size,
            self.config.num_blocks,
            eos_token_id=EOS,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            **self.worker_kwargs,
        )
        self.prompts: dict[str, list[int]] = {}
        self.sampling: dict[str, SamplingParams] = {}
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, RequestOutput] = {}
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.plans: list[StepPlan] = []

    # -------------------------------------------------------------- intake

    def add(
        self,
        request_id: str,
        prompt_len: int = 4,
        max_tokens: int = 4,
        prompt: list[int] | None = None,
        **sampling,
    ) -> RequestOutput | None:
        prompt = make_prompt(request_id, prompt_len) if prompt is None else prompt
        msg = AddRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, **sampling), 1000.0)
        rejected = self.scheduler.add_request(msg)
        if rejected is None:
            self.prompts[request_id] = list(prompt)
            self.sampling[request_id] = msg.sampling
        self.check()
        return rejected

    def abort(self, *request_ids: str) -> list[RequestOutput]:
        outs = self.scheduler.abort(list(request_ids))
        self.record(outs)
        self.check()
        return outs

    # -------------------------------------------------------------- stepping

    def schedule(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        self.check()
        if plan is not None:
            self.plans.append(plan)
        return plan

    def finish_step(self, plan: StepPlan, result: StepResult | None = None) -> list[RequestOutput]:
        if result is None:
            result = self.worker.execute(plan)
        outs = self.scheduler.update(plan, result)
        self.record(outs)
        self.check()
        return outs

    def step(self) -> StepPlan | None:
        plan = self.schedule()
        if plan is not None:
            self.finish_step(plan)
        return plan

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is live; the number of steps taken."""
        steps = 0
        while self.scheduler.has_work():
            assert self.step() is not None, "live requests but no plan"
            steps += 1
            assert steps <= max_steps, "no progress"
        assert self.scheduler.schedule() is None
        self.check_idle()
        return steps

    # -------------------------------------------------------------- bookkeeping

    def record(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            assert o.request_id not in self.final, f"{o.request_id} got output after finishing"
            self.outputs.setdefault(o.request_id, []).append(o)
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.final[o.request_id] = o

    def check(self) -> None:
        self.scheduler.check_invariants()
        pool = self.scheduler.pool
        assert pool.num_free + pool.num_held == pool.total

    def check_idle(self) -> None:
        pool = self.scheduler.pool
        assert pool.num_free == pool.total, f"{pool.num_held} blocks still held"
        assert self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0

    def expected_tokens(self, request_id: str, n: int) -> list[int]:
        return self.worker.expected_outputs(request_id, len(self.prompts[request_id]), n)

    def alone(self, request_id: str) -> tuple[list[int], str]:
        """The outputs and finish reason of a request run alone to its natural end."""
        sp = self.sampling[request_id]
        plen = len(self.prompts[request_id])
        out: list[int] = []
        while True:
            t = self.worker.token_for(request_id, plen + len(out))
            out.append(t)
            if (t == EOS and not sp.ignore_eos) or t in sp.stop_token_ids:
                return out, "stop"
            if len(out) >= sp.max_tokens or plen + len(out) >= self.config.max_model_len:
                return out, "length"

    def check_outcomes(self) -> None:
        """Every accepted request finished once, with the tokens it would have had alone
        (a prefix of them when aborted or failed)."""
        assert set(self.final) >= set(self.prompts)
        for rid in self.prompts:
            expected, reason = self.alone(rid)
            got, final = self.tokens.get(rid, []), self.final[rid]
            if final.finish_reason in ("abort", "error"):
                assert got == expected[: len(got)], rid
            else:
                assert (got, final.finish_reason) == (expected, reason), rid

    def scheduled_in(self, plan: StepPlan) -> dict[str, int]:
        out = {r.request_id: r.num_scheduled_tokens for r in plan.new_requests}
        out.update({r.request_id: r.num_scheduled_tokens for r in plan.cached_requests})
        return out
