"""Property tests: random arrivals with priorities, shared prefixes, continuations, aborts
(also while a step runs), worker failures, time passing, small pools and swap spaces, under
random policies (fcfs / priority with aging, swap / recompute / auto, bypass bounds, queue
bounds, batch formation).

After every rule the harness checks the scheduler's invariants (each GPU and CPU block is
exactly one of free, cached, or held with a reference count equal to the block tables
naming it; running/waiting consistent; prefix index in sync) and the FakeWorker has checked
every plan it executed, including the contents of every KV slot a request relied on. Around
every scheduling step the machine checks the line: a request that was waiting is passed only
by requests ranked ahead of it (for ``priority``: a higher effective priority ``p + rate *
waited``, so a later arrival passes it only while ``arrival gap < priority gap / rate``) or by
a bounded bypass, and a never-admitted request never waits past ``max_queue_time``. At the
end the machine drains the scheduler and checks that every accepted submission finished
exactly once, with exactly the tokens and finish reason it would have had running alone (a
prefix of them when aborted or failed), and that every block is released.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conveyor.ipc.messages import FinishReason
from conveyor.runtime.config import SchedulerConfig
from conveyor.scheduler.policy import blocks_for
from conveyor.scheduler.request import RequestStatus
from tests.scheduler.fake_worker import default_token
from tests.scheduler.scheduler_harness import Harness

SYSTEM_PROMPT = [900 + i for i in range(24)]  # shared by some prompts: prefix-cache hits


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.n = 0

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        max_model_len=st.integers(2, 48),
        policy=st.sampled_from(["fcfs", "priority"]),
        aging_rate=st.sampled_from([0.0, 0.5, 3.0]),
        preemption=st.sampled_from(["swap", "recompute", "auto"]),
        num_cpu_blocks=st.sampled_from([0, 2, 8, 32]),
        offload=st.booleans(),
        max_bypass=st.integers(0, 4),
        max_waiting=st.sampled_from([0, 0, 3, 8]),
        max_queue_time=st.sampled_from([0.0, 0.0, 2.0, 5.0]),
        min_batch_size=st.sampled_from([1, 1, 2, 3]),
        max_wait_ms=st.sampled_from([0.0, 300.0]),
        block_bytes=st.sampled_from([0, 100, 10**9]),
        static=st.booleans(),
        overlap=st.booleans(),
    )
    def setup(
        self,
        block_size,
        num_blocks,
        max_num_seqs,
        budget,
        max_model_len,
        policy,
        aging_rate,
        preemption,
        num_cpu_blocks,
        offload,
        max_bypass,
        max_waiting,
        max_queue_time,
        min_batch_size,
        max_wait_ms,
        block_bytes,
        static,
        overlap,
    ) -> None:
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            batching="static" if static and policy == "fcfs" else "continuous",
            policy=policy,
            aging_rate=aging_rate,
            preemption=preemption,
            num_cpu_blocks=num_cpu_blocks,
            offload_evicted=offload,
            max_bypass=max_bypass,
            max_waiting=max_waiting,
            max_queue_time=max_queue_time,
            min_batch_size=min_batch_size,
            max_wait_ms=max_wait_ms,
            block_bytes=block_bytes,
            prefill_rate=1000.0,
            swap_bandwidth=1e6,
        )
        self.h = Harness(self.config, overlap=overlap)
        self.capacity = min(max_model_len, num_blocks * block_size)
        self.batch_cutoff: int | None = None  # static: the last arrival (seq) the batch may take
        self.batch_members = 0
        self.batch_complete = False

    # ------------------------------------------------------------ arrivals

    @precondition(lambda self: self.h is not None)
    @rule(
        prompt_len=st.integers(0, 40),
        max_tokens=st.integers(0, 24),
        priority=st.integers(0, 3),
        eos_offset=st.none() | st.integers(0, 20),
    )
    def add_any(self, prompt_len, max_tokens, priority, eos_offset) -> None:
        """Any request, often one the scheduler must reject."""
        self._add(f"r{self.n}", None, prompt_len, max_tokens, priority, eos_offset, None, False)

    @precondition(lambda self: self.h is not None and self.capacity >= 2)
    @rule(
        data=st.data(),
        priority=st.integers(0, 3),
        shared=st.booleans(),
        eos_offset=st.none() | st.integers(0, 20),
        stop_offset=st.none() | st.integers(0, 20),
        ignore_eos=st.booleans(),
    )
    def add_fitting(self, data, priority, shared, eos_offset, stop_offset, ignore_eos) -> None:
        """A request that fits the model and the pool; some start with a shared system prompt."""
        total = data.draw(st.integers(2, self.capacity), label="total")
        prompt_len = data.draw(st.integers(1, total - 1), label="prompt_len")
        rid = f"r{self.n}"
        prompt = None
        if shared:
            prompt = (SYSTEM_PROMPT + [1 + self.n % 900] * prompt_len)[:prompt_len]
        self._add(rid, prompt, prompt_len, total - prompt_len, priority, eos_offset, stop_offset, ignore_eos)

    # (Not under static batching, whose model here knows only requests queued at arrival.)
    @precondition(lambda self: self.h is not None and self.capacity >= 2 and self.config.batching != "static")
    @rule(data=st.data(), n=st.integers(2, 4), priority=st.integers(0, 3), eos_offset=st.none() | st.integers(0, 20))
    def add_parallel(self, data, n, priority, eos_offset) -> None:
        """A parallel-sampling request: ``n`` sequences of one prompt (each its own tokens)."""
        total = data.draw(st.integers(2, self.capacity), label="total")
        prompt_len = data.draw(st.integers(1, total - 1), label="prompt_len")
        rid = f"r{self.n}"
        if eos_offset is not None:  # (one of its sequences stops early)
            self.h.worker.eos_at[f"{rid}/{n - 1}"] = prompt_len + eos_offset
        self._add(rid, None, prompt_len, total - prompt_len, priority, None, None, False, n=n)

    @precondition(lambda self: self.h is not None and self.continuable())
    @rule(data=st.data(), extra=st.integers(1, 6), priority=st.integers(0, 3))
    def continue_finished(self, data, extra, priority) -> None:
        """A new turn of a finished request: same id, its prompt + outputs + more input."""
        key = data.draw(st.sampled_from(self.continuable()), label="turn")
        rid = self.h.rid_of[key]
        context = self.h.context(key)
        prompt = context + [1 + (7 * i + len(context)) % 900 for i in range(extra)]
        max_tokens = data.draw(st.integers(1, 8), label="max_tokens")
        self._add(rid, prompt, len(prompt), max_tokens, priority, None, None, False, new_id=False)

    def continuable(self) -> list[str]:
        h = self.h
        return sorted(
            k
            for k, o in h.final.items()
            if o.finish_reason in ("stop", "length", "abort")
            and h.rid_of[k] not in h.live_key
            and h.submissions[h.rid_of[k]] == self._turns(k)
        )

    @staticmethod
    def _turns(key: str) -> int:
        return 1 if "#" not in key else int(key.split("#")[1]) + 1

    def _add(
        self, rid, prompt, prompt_len, max_tokens, priority, eos_offset, stop_offset, ignore_eos, new_id=True, n=1
    ):
        h = self.h
        if new_id:
            self.n += 1
        if eos_offset is not None:
            h.worker.eos_at[rid] = prompt_len + eos_offset
        stop_ids = [] if stop_offset is None else [default_token(rid, prompt_len + stop_offset)]
        waiting_before = h.scheduler.num_waiting
        out = h.add(
            rid,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            prompt=prompt,
            priority=priority,
            stop_token_ids=stop_ids,
            ignore_eos=ignore_eos,
            n=n,
        )
        cfg = self.config
        total = prompt_len + max_tokens
        serviceable = (
            prompt_len > 0
            and max_tokens > 0
            and total <= cfg.max_model_len
            and blocks_for(total, cfg.block_size) <= cfg.num_blocks
        )
        if not serviceable:
            assert out is not None and out.finish_reason == FinishReason.ERROR and out.error
        elif out is not None:
            assert out.error.startswith("overloaded:") and waiting_before >= cfg.max_waiting > 0, out.error

    # ------------------------------------------------------------ aborts and time

    @precondition(lambda self: self.h is not None and self.n > 0)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rids = data.draw(st.lists(st.sampled_from([f"r{i}" for i in range(self.n)] + ["ghost"]), max_size=3))
        was_live = set().union(*(self.h.live_ids(r) for r in rids))
        outs = self.h.abort(*rids)
        assert {o.request_id for o in outs} == was_live
        assert all(o.finish_reason == FinishReason.ABORT for o in outs)

    @precondition(lambda self: self.h is not None)
    @rule(seconds=st.sampled_from([0.05, 0.2, 1.0, 3.0]))
    def advance_clock(self, seconds) -> None:
        self.h.clock.advance(seconds)

    # ------------------------------------------------------------ steps

    @precondition(lambda self: self.h is not None)
    @rule(times=st.integers(1, 4))
    def step(self, times) -> None:
        for _ in range(times):
            self._checked_step()

    @precondition(lambda self: self.h is not None)
    @rule(data=st.data())
    def step_with_abort_during_it(self, data) -> None:
        if not self._fill_pipeline():
            return
        in_plan = sorted(set().union(*(self.h.live_in_plan(p) for p in self.h.inflight)))
        victims = data.draw(st.lists(st.sampled_from(in_plan), max_size=len(in_plan), unique=True)) if in_plan else []
        self.h.abort(*victims)
        outs = self.h.finish_step()
        assert not {o.request_id for o in outs} & set(victims)

    @precondition(lambda self: self.h is not None)
    @rule(fail=st.integers(0, 3))
    def failing_step(self, fail) -> None:
        """Usually a plain step; a quarter of the time the worker fails it (and the plan
        planned ahead of it, if any: its requests fail at once)."""
        if fail:
            self._checked_step()
            return
        if not self._fill_pipeline():
            return
        plan = self.h.inflight[0]
        self.h.worker.fail_steps.add(plan.step_id)
        # A plan planned ahead of the failing one fails with it (its requests at once).
        expected = set().union(*(self.h.live_in_plan(p) for p in self.h.inflight))
        outs = self.h.finish_step(plan)
        assert {o.request_id for o in outs} == expected
        assert all(o.finish_reason == FinishReason.ERROR for o in outs)

    def _fill_pipeline(self) -> bool:
        """Plan (and, in overlap mode, plan ahead) as the process loop would; whether a plan is in flight."""
        if not self.h.inflight and self._checked_schedule() is None:
            return False
        if self.h.overlap and self.h.scheduler.can_plan_ahead:
            self._checked_schedule()
        return True

    def _checked_step(self) -> None:
        had_work = self.h.scheduler.has_work()
        if self._fill_pipeline():
            self.h.finish_step()
        elif had_work and self.h.scheduler.has_work():  # (a queue timeout may have ended the last one)
            assert self.h.scheduler.seconds_until_ready() is not None, "live requests, no plan, nothing to wait for"

    def _checked_schedule(self):
        """schedule(), checking the order of the line: who passed whom, and the queue timeout."""
        h, cfg = self.h, self.config
        sched = h.scheduler
        now = h.clock.now
        waiting = {id(r): r for r in sched.state.queue}
        bypassed_before = {id(r): r.num_bypassed for r in waiting.values()}
        running_before = sched.num_running
        plan = h.schedule()
        static = cfg.batching == "static"
        if plan is None:
            if static and not sched.state.declined:  # (declined: it stopped before admitting anything)
                self._check_static_batch(running_before, list(waiting.values()), [], None)
            return None
        admitted = [sched.get_request(d.request_id) for d in plan.new_requests]
        admitted = [r for r in admitted if r is not None and id(r) in waiting]
        if static:
            self._check_static_batch(running_before, list(waiting.values()), admitted, plan)
        still = [r for r in waiting.values() if r.queue_entry is not None]
        for x in admitted:
            for r in still:
                if self._ahead(r, x):
                    assert r.num_bypassed > bypassed_before[id(r)], (
                        f"{x.request_id} passed {r.request_id} without a bypass"
                    )
        for r in sched.state.queue:
            assert r.num_bypassed <= cfg.max_bypass
            # (a parallel-sampling request's later sequences queue once its leader was admitted)
            follower = r.group is not None and r is not r.group.leader
            if cfg.max_queue_time and r.status is RequestStatus.WAITING and not follower:
                assert now - r.enqueue_time <= cfg.max_queue_time, f"{r.request_id} waited past max_queue_time"
        return plan

    def _check_static_batch(self, running_before: int, waiting_before: list, admitted: list, plan) -> None:
        """Static batching from first principles (fcfs): a batch forms only when nobody runs and
        none of its members still waits; it takes only requests that were waiting when it
        formed, ``max_num_seqs`` at most over its whole life, and none once an admission
        stopped short with budget left (a member lacked blocks); nobody is ever preempted."""
        assert self.h.scheduler.stats()["num_preemptions"] == 0, "a static batch preempted a member"
        taken = {id(r) for r in admitted}
        cutoff = self.batch_cutoff

        def members_waiting() -> bool:
            return cutoff is not None and any(
                r.rank[1] <= cutoff and (id(r) in taken or r.queue_entry is not None) for r in waiting_before
            )

        if admitted:
            if running_before == 0 and (self.batch_complete or not members_waiting()):  # it has left
                cutoff = self.batch_cutoff = max(r.rank[1] for r in waiting_before)
                self.batch_members, self.batch_complete = 0, False
            else:
                late = [r.request_id for r in admitted if r.rank[1] > cutoff]
                assert not late and not self.batch_complete, f"{late} joined a static batch that had not left"
            self.batch_members += len(admitted)
            assert self.batch_members <= self.config.max_num_seqs, "a static batch took more than max_num_seqs"
            self.batch_complete = self.batch_members == self.config.max_num_seqs
        taken = set()
        used = sum(self.h.scheduled_in(plan).values()) if plan is not None else 0
        if used < self.config.max_num_batched_tokens and members_waiting():
            self.batch_complete = True  # admission stopped short of a member with budget left

    def _ahead(self, r, x) -> bool:
        """Whether waiting request ``r`` is ahead of ``x`` in line, from first principles."""
        if self.config.policy == "fcfs":
            return r.enqueue_time < x.enqueue_time or (r.enqueue_time == x.enqueue_time and r.rank < x.rank)
        rate = self.config.aging_rate
        gap = x.enqueue_time - r.enqueue_time  # how much later x arrived
        lead = x.priority - r.priority
        if abs(lead - rate * gap) > 1e-6:
            # x outranks r only while its priority lead exceeds what r gained by waiting longer
            return lead < rate * gap
        return r.rank < x.rank  # a tie (up to rounding): the earlier arrival goes first

    @invariant()
    def consistent(self) -> None:
        if self.h is None:
            return
        self.h.check()
        s = self.h.scheduler
        assert s.num_running + s.num_waiting == len(self.h.live_key)
        assert s.has_work() == bool(self.h.live_key)

    # ------------------------------------------------------------ the end

    def teardown(self) -> None:
        if self.h is None:
            return
        h = self.h
        h.run(max_steps=20_000)
        h.check_outcomes()
        for key, out in h.final.items():
            if out.error and out.error.startswith("timeout:"):
                assert not h.tokens.get(key)


SchedulerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase


def _random_load(seed: int) -> dict:
    """Heavy random load on a tight pool (odd seeds plan ahead); returns the scheduler's stats."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(2, 12)
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(1, 32),
        max_model_len=rng.randint(2, 64),
        policy=rng.choice(["fcfs", "priority"]),
        aging_rate=rng.choice([0.0, 1.0]),
        preemption=rng.choice(["swap", "recompute", "auto"]),
        num_cpu_blocks=rng.choice([0, 4, 16]),
        offload_evicted=rng.random() < 0.5,
        block_bytes=rng.choice([0, 10**9]),
    )
    capacity = min(config.max_model_len, num_blocks * block_size)
    h = Harness(config, overlap=seed % 2 == 1)
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
            prompt = (SYSTEM_PROMPT + [n % 900 + 1] * plen)[:plen] if rng.random() < 0.3 else None
            h.add(
                rid,
                prompt_len=plen,
                max_tokens=max_tokens,
                prompt=prompt,
                priority=rng.randint(0, 3),
                ignore_eos=rng.random() < 0.1,
            )
        if n and rng.random() < 0.05:
            h.abort(f"q{rng.randrange(n)}")
        h.clock.advance(rng.choice([0.0, 0.1, 1.0]))
        plan = h.inflight[0] if h.inflight else h.schedule()
        if plan is None:
            continue
        h.plan_ahead()
        if rng.random() < 0.05:
            h.abort(rng.choice(sorted(h.scheduled_in(plan))))
        if rng.random() < 0.02:
            h.worker.fail_steps.add(plan.step_id)
        h.finish_step(plan)
    h.run(max_steps=50_000)
    h.check_outcomes()
    return h.scheduler.stats()


def test_random_load_on_tight_pools():
    stats = [_random_load(seed) for seed in range(40)]
    # The scenario does exercise both kinds of preemption and the prefix cache.
    assert sum(s["num_preemptions_recompute"] > 0 for s in stats) >= 5, stats
    assert sum(s["num_preemptions_swap"] > 0 for s in stats) >= 5, stats
    assert sum(s["prefix_cache_hit_tokens"] > 0 for s in stats) >= 10, stats
