"""Property test: random arrivals, prompt lengths, max_tokens, stop conditions, aborts
(also while a step runs), worker failures and small pools.

After every rule the harness checks the scheduler's invariants (free + held == total,
no block held twice, running/waiting consistent) and the FakeWorker has checked every
plan it executed. At the end the machine drains the scheduler and checks that every
accepted request finished exactly once, with exactly the tokens and finish reason it
would have had running alone (or a prefix of them when aborted or failed), and that
every block is free.
"""

from __future__ import annotations

import random

from fake_worker import default_token
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from scheduler_harness import EOS, Harness

from conveyor.common.config import SchedulerConfig
from conveyor.common.messages import AddRequest, FinishReason, SamplingParams
from conveyor.scheduler.policy import blocks_for


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.n = 0
        self.accepted: set[str] = set()

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        max_model_len=st.integers(2, 48),
    )
    def setup(self, block_size, num_blocks, max_num_seqs, budget, max_model_len) -> None:
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
        )
        self.h = Harness(self.config)
        self.capacity = min(max_model_len, num_blocks * block_size)

    # ------------------------------------------------------------ arrivals

    @rule(
        prompt_len=st.integers(0, 40),
        max_tokens=st.integers(0, 24),
        eos_offset=st.none() | st.integers(0, 20),
        stop_offset=st.none() | st.integers(0, 20),
        ignore_eos=st.booleans(),
    )
    def add_any(self, prompt_len, max_tokens, eos_offset, stop_offset, ignore_eos) -> None:
        """Any request, often one the scheduler must reject."""
        self._add(prompt_len, max_tokens, eos_offset, stop_offset, ignore_eos)

    @precondition(lambda self: self.h is not None and self.capacity >= 2)
    @rule(
        data=st.data(),
        eos_offset=st.none() | st.integers(0, 20),
        stop_offset=st.none() | st.integers(0, 20),
        ignore_eos=st.booleans(),
    )
    def add_fitting(self, data, eos_offset, stop_offset, ignore_eos) -> None:
        """A request the scheduler must accept: prompt + max_tokens within the model and pool."""
        total = data.draw(st.integers(2, self.capacity), label="total")
        prompt_len = data.draw(st.integers(1, total - 1), label="prompt_len")
        self._add(prompt_len, total - prompt_len, eos_offset, stop_offset, ignore_eos)

    def _add(self, prompt_len, max_tokens, eos_offset, stop_offset, ignore_eos) -> None:
        rid = f"r{self.n}"
        self.n += 1
        if eos_offset is not None:
            self.h.worker.eos_at[rid] = prompt_len + eos_offset
        stop_ids = [] if stop_offset is None else [default_token(rid, prompt_len + stop_offset)]
        out = self.h.add(
            rid, prompt_len=prompt_len, max_tokens=max_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos
        )
        cfg = self.config
        total = prompt_len + max_tokens
        serviceable = (
            prompt_len > 0
            and max_tokens > 0
            and total <= cfg.max_model_len
            and blocks_for(total, cfg.block_size) <= cfg.num_blocks
        )
        if serviceable:
            assert out is None
            self.accepted.add(rid)
        else:
            assert out is not None and out.finish_reason == FinishReason.ERROR and out.error

    @precondition(lambda self: self.h is not None and self.h.scheduler.has_work())
    @rule(data=st.data())
    def add_duplicate(self, data) -> None:
        live = sorted(self.accepted - set(self.h.final))
        rid = data.draw(st.sampled_from(live))
        out = self.h.scheduler.add_request(AddRequest(rid, [1, 2], SamplingParams(max_tokens=1), 0.0))
        assert out is not None and "already in use" in out.error
        self.h.check()

    # ------------------------------------------------------------ aborts

    @precondition(lambda self: self.h is not None and self.n > 0)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from([f"r{i}" for i in range(self.n)] + ["ghost"]), max_size=3))
        was_live = {r for r in rids if r in self.accepted and r not in self.h.final}
        outs = self.h.abort(*rids)
        assert {o.request_id for o in outs} == was_live
        assert all(o.finish_reason == FinishReason.ABORT for o in outs)

    # ------------------------------------------------------------ steps

    @rule(times=st.integers(1, 4))
    def step(self, times) -> None:
        for _ in range(times):
            had_work = self.h.scheduler.has_work()
            plan = self.h.step()
            assert (plan is not None) == had_work, "live requests but no plan, or a plan from nothing"

    @rule(data=st.data())
    def step_with_abort_during_it(self, data) -> None:
        plan = self.h.schedule()
        if plan is None:
            return
        in_plan = sorted(self.h.scheduled_in(plan))
        victims = data.draw(st.lists(st.sampled_from(in_plan), max_size=len(in_plan), unique=True))
        self.h.abort(*victims)
        outs = self.h.finish_step(plan)
        assert not {o.request_id for o in outs} & set(victims)

    @rule(fail=st.integers(0, 3))
    def failing_step(self, fail) -> None:
        """Usually a plain step; a quarter of the time the worker fails it."""
        if fail:
            self.step(1)
            return
        plan = self.h.schedule()
        if plan is None:
            return
        self.h.worker.fail_steps.add(plan.step_id)
        outs = self.h.finish_step(plan)
        assert {o.request_id for o in outs} == set(self.h.scheduled_in(plan))
        assert all(o.finish_reason == FinishReason.ERROR for o in outs)

    @invariant()
    def consistent(self) -> None:
        if self.h is None:
            return
        self.h.check()
        s = self.h.scheduler
        live = self.accepted - set(self.h.final)
        assert s.num_running + s.num_waiting == len(live)
        assert s.has_work() == bool(live)

    # ------------------------------------------------------------ the end

    def teardown(self) -> None:
        if self.h is None:
            return
        h = self.h
        h.run(max_steps=20_000)
        h.check_outcomes()
        assert set(h.prompts) == self.accepted


SchedulerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase


def _random_load(seed: int) -> int:
    """Heavy random load on a tight pool; returns how many preemptions it caused."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(2, 12)
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(1, 32),
        max_model_len=rng.randint(2, 64),
    )
    capacity = min(config.max_model_len, num_blocks * block_size)
    h = Harness(config)
    n = 0
    for _ in range(300):
        for _ in range(rng.choice([0, 0, 1, 2])):
            rid = f"q{n}"
            n += 1
            if capacity >= 2 and rng.random() < 0.9:
                total = rng.randint(2, capacity)
                plen = rng.randint(1, total - 1)
                max_tokens = total - plen
            else:
                plen, max_tokens = rng.randint(0, 70), rng.randint(0, 30)
            if rng.random() < 0.2:
                h.worker.eos_at[rid] = plen + rng.randint(0, 10)
            h.add(rid, prompt_len=plen, max_tokens=max_tokens, ignore_eos=rng.random() < 0.1)
        if n and rng.random() < 0.05:
            h.abort(f"q{rng.randrange(n)}")
        plan = h.schedule()
        if plan is None:
            continue
        if rng.random() < 0.05:
            h.abort(rng.choice(sorted(h.scheduled_in(plan))))
        if rng.random() < 0.02:
            h.worker.fail_steps.add(plan.step_id)
        h.finish_step(plan)
    h.run(max_steps=50_000)
    h.check_outcomes()
    return h.scheduler.stats()["num_preemptions"]


def test_random_load_on_tight_pools():
    preemptions = [_random_load(seed) for seed in range(40)]
    assert sum(p > 0 for p in preemptions) >= 10, preemptions  # the scenario does exercise preemption
