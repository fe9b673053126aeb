"""What the scenario test modules of the scheduler share: the small pool they start from
and the ways they read a plan or check a request's tokens.

Every scenario names its overrides against :data:`SCENARIO_POOL`, so one place says what a
bare ``cfg()`` means; a module that starts from another base (the rules' longer model, the
static batching baseline) puts its own defaults in front of the scenario's overrides.
"""

from __future__ import annotations

from conveyor.ipc.messages import NewRequestData, StepPlan
from conveyor.runtime.config import SchedulerConfig
from tests.scheduler.scheduler_harness import Harness

# 64 blocks of 4 tokens, 8 slots, a 64-token budget, a 128-token model.
SCENARIO_POOL = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)


def cfg(**overrides) -> SchedulerConfig:
    """The scenario pool with ``overrides`` on top."""
    return SchedulerConfig(**{**SCENARIO_POOL, **overrides})


def rules_cfg(**overrides) -> SchedulerConfig:
    """The scenario pool for the rule scenarios: a 256-token model unless overridden."""
    return cfg(**{"max_model_len": 256, **overrides})


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def new_ids(plan: StepPlan) -> list[str]:
    """The ids the plan admits, in its order."""
    return ids(plan.new_requests)


def new_req(plan: StepPlan, rid: str) -> NewRequestData:
    (r,) = [r for r in plan.new_requests if r.request_id == rid]
    return r


def assert_alone_tokens(h: Harness, *rids: str) -> None:
    """Each request produced exactly the tokens it would have produced running alone."""
    for rid in rids:
        got = h.tokens[rid]
        assert got == h.expected_tokens(rid, len(got)), rid
