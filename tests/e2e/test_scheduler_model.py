"""The real Scheduler driving the real ModelRunner in one process, on the tiny checkpoint (CPU).

Requests that were swapped out and back in, preempted and recomputed, prefilled in chunks,
served partly from the prefix cache (a shared system prompt), or continued (a second turn
under the same id) must produce exactly transformers' greedy tokens for their whole context
(the checkpoint is position-sensitive, so KV at a wrong position or in a wrong block shows). Each
scenario also checks, through the plans and the scheduler's stats, that the mechanism it is
about really happened.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from conveyor.ipc.messages import AddRequest, SamplingParams
from conveyor.runtime.config import RunnerConfig, SchedulerConfig
from conveyor.scheduler.scheduler import Scheduler
from tests import plans

BLOCK_SIZE = 4
SYSTEM = [5, 17, 29, 41, 53, 65, 77, 89]  # two full blocks shared by several prompts


def prompts() -> dict[str, list[int]]:
    out = {}
    for i in range(6):
        own = [(31 * i + 7 * j) % 150 + 3 for j in range(3 + 5 * i)]
        out[f"r{i}"] = (SYSTEM + own) if i % 2 == 0 else own
    return out


@pytest.fixture(scope="module")
def runner_factory(tiny_checkpoint):
    from conveyor.worker.model_runner import ModelRunner

    torch.set_num_threads(2)

    def make(num_blocks: int = 256, num_cpu_blocks: int = 0) -> ModelRunner:
        return ModelRunner(
            RunnerConfig(
                tiny_checkpoint,
                block_size=BLOCK_SIZE,
                num_blocks=num_blocks,
                num_cpu_blocks=num_cpu_blocks,
            ),
        )

    return make


class Driver:
    """The scheduler process loop without sockets: schedule (ahead, with ``overlap``), execute, update.

    ``pipelined`` drives the runner as the worker's pipelined loop does (worker/main.py): a
    plan formed ahead is launched before the step it was planned ahead of is finished, so
    its decode inputs are tokens only the device has seen. It implies ``overlap``.
    """

    def __init__(self, runner, overlap: bool = False, pipelined: bool = False, **config) -> None:
        cfg = dict(
            num_blocks=runner.num_blocks, block_size=BLOCK_SIZE, max_model_len=256, num_cpu_blocks=runner.num_cpu_blocks
        )
        cfg.update(config)
        self.scheduler = Scheduler(SchedulerConfig(**cfg), eos_token_ids=[], vocab_size=runner.model_config.vocab_size)
        self.runner = runner
        self.overlap = overlap or pipelined
        self.pipelined = pipelined
        self.inflight = deque()
        self.unlaunched = deque()  # pipelined: plans formed, not launched yet
        self.launched = deque()  # pipelined: (plan, launched step) not finished yet
        self.tokens: dict[str, list[int]] = {}
        self.plans = []

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert self.scheduler.add_request(AddRequest(rid, prompt, sampling, 0.0, priority)) is None
        self.tokens[rid] = []

    def _schedule(self) -> bool:
        plan = self.scheduler.schedule()
        if plan is not None:
            self.plans.append(plan)
            self.inflight.append(plan)
            self.unlaunched.append(plan)
        return plan is not None

    def step(self) -> bool:
        if self.pipelined:
            return self._step_pipelined()
        if not self.inflight and not self._schedule():
            return False
        if self.overlap and self.scheduler.can_plan_ahead:
            self._schedule()
        plan = self.inflight.popleft()
        self.unlaunched.popleft()
        self._apply(plan, self.runner.execute(plan))
        return True

    def _step_pipelined(self) -> bool:
        formed = self._schedule() if not self.inflight or self.scheduler.can_plan_ahead else False
        if self.unlaunched:
            plan = self.unlaunched.popleft()
            self.launched.append((plan, self.runner.launch(plan)))
        if not self.launched:
            return False
        if len(self.launched) == 2 or not formed:  # the next step is queued, or none can be formed yet
            self._finish_oldest()
        return True

    def settle(self) -> None:
        """Finish every launched step (pipelined), as the worker does when no plan follows."""
        while self.launched:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        plan, launched = self.launched.popleft()
        assert self.inflight.popleft() is plan
        self._apply(plan, self.runner.finish(launched))

    def _apply(self, plan, result) -> None:
        assert result.error is None
        for out in plans.expanded(self.scheduler.update(plan, result)):
            assert out.finish_reason in (None, "length"), out
            self.tokens[out.request_id] += out.new_token_ids
        self.scheduler.check_invariants()

    def run(self) -> dict[str, list[int]]:
        while self.scheduler.has_work() or self.inflight:
            assert self.step(), "live requests but nothing to run"
        return self.tokens

    def new_requests(self, rid: str):
        return [r for p in self.plans for r in p.new_requests if r.request_id == rid]


def check_all_hf(driver: Driver, prompts: dict[str, list[int]], max_tokens: dict[str, int], hf_greedy) -> None:
    for rid, prompt in prompts.items():
        assert driver.tokens[rid] == hf_greedy(prompt, max_tokens[rid]), rid


def check_planned_ahead(driver: Driver) -> None:
    ahead = sum(p.planned_ahead for p in driver.plans)
    assert (ahead > 0) == driver.overlap, f"{ahead} of {len(driver.plans)} plans planned ahead"


LOOPS = {"sync": {}, "overlap": {"overlap": True}, "pipelined": {"pipelined": True}}


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_and_chunked_requests_match_hf(runner_factory, hf_greedy, mode, loop):
    runner = runner_factory(num_blocks=18, num_cpu_blocks=64)
    driver = Driver(runner, **LOOPS[loop], max_num_seqs=6, max_num_batched_tokens=12, preemption=mode)
    ps = prompts()
    max_tokens = {rid: 14 + 2 * i for i, rid in enumerate(ps)}
    for rid, prompt in ps.items():
        driver.add(rid, prompt, max_tokens[rid])
    driver.run()
    check_all_hf(driver, ps, max_tokens, hf_greedy)
    check_planned_ahead(driver)
    stats = driver.scheduler.stats()
    assert stats[f"num_preemptions_{mode}"] > 0, stats
    chunked = [
        r
        for p in driver.plans
        for r in p.new_requests
        if r.num_computed_tokens + r.num_scheduled_tokens < len(r.token_ids)
    ]
    assert chunked, "no prompt was prefilled in chunks"
    if mode == "swap":
        assert stats["num_swapped_in_blocks"] > 0
        resumed = [r for p in driver.plans if p.swap_in for r in p.new_requests if r.num_computed_tokens > 0]
        assert resumed, "no request resumed from swapped-in blocks"
    else:
        assert stats["num_swapped_out_blocks"] == 0


@pytest.mark.parametrize("loop", list(LOOPS))
def test_prefix_cached_and_continued_requests_match_hf(runner_factory, hf_greedy, loop):
    runner = runner_factory(num_blocks=128)
    driver = Driver(runner, **LOOPS[loop], max_num_seqs=8, max_num_batched_tokens=64)
    ps = prompts()
    max_tokens = {rid: 9 for rid in ps}
    first = "r0"
    driver.add(first, ps[first], max_tokens[first])
    driver.step()  # r0's system prompt is computed and registered
    driver.settle()
    for rid, prompt in ps.items():
        if rid != first:
            driver.add(rid, prompt, max_tokens[rid])
    driver.run()
    check_all_hf(driver, ps, max_tokens, hf_greedy)
    for rid in ("r2", "r4"):  # the others that start with the system prompt
        (new,) = driver.new_requests(rid)
        assert new.num_computed_tokens == len(SYSTEM), rid
    assert driver.scheduler.stats()["prefix_cache_hit_tokens"] >= 2 * len(SYSTEM)

    # Second turns: the same ids, their whole context plus new input.
    turn2 = {}
    for rid in ("r1", "r4"):
        context = ps[rid] + driver.tokens[rid]
        turn2[rid] = context + [11, 12, 13]
        driver.tokens[rid] = []
        driver.add(rid, turn2[rid], 7)
    driver.run()
    for rid, prompt in turn2.items():
        new = driver.new_requests(rid)[-1]
        context_len = len(prompt) - 3
        assert new.num_computed_tokens == context_len - 1, rid  # only the new tokens (and the last output) run
        assert driver.tokens[rid] == hf_greedy(prompt, 7), rid
    check_planned_ahead(driver)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipelined_steps_give_the_same_tokens(tiny_checkpoint):
    """On CUDA, where a launch only queues the step: decode inputs taken from the device-side
    buffer of the step still running give the tokens the plain loop gives (which
    tests/worker/test_cuda_worker.py checks against transformers)."""
    from conveyor.worker.model_runner import ModelRunner

    def serve(pipelined: bool) -> dict[str, list[int]]:
        runner = ModelRunner(RunnerConfig(tiny_checkpoint, device="cuda", block_size=BLOCK_SIZE, num_blocks=256))
        driver = Driver(runner, overlap=True, pipelined=pipelined, max_num_seqs=6, max_num_batched_tokens=24)
        for rid, prompt in prompts().items():
            driver.add(rid, prompt, 12)
        return driver.run()

    assert serve(pipelined=True) == serve(pipelined=False)
