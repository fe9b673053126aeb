"""A worker stand-in that executes StepPlans the way the real worker must, and checks them.

It keeps what the real model runner keeps per request (token list, block table, computed
count) and asserts every rule of the plan protocol in ``conveyor.common.messages``, so a
scheduler bug shows up as an AssertionError at the step that broke the rule. Sampled
tokens are a pure function of (request id, position), so a request produces the same
tokens whatever it is batched with and however often it is preempted and recomputed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.common.messages import StepPlan, StepResult


def default_token(request_id: str, position: int, low: int = 1, high: int = 1000) -> int:
    """A deterministic token in ``[low, high)`` for the token at ``position`` of a request."""
    return low + zlib.crc32(f"{request_id}:{position}".encode()) % (high - low)


@dataclass
class _State:
    tokens: list[int]
    blocks: list[int]
    computed: int


@dataclass
class FakeWorker:
    """Executes plans with the real worker's bookkeeping and checks them.

    ``eos_at`` maps a request id to the absolute token position (index into prompt +
    outputs) at which the worker samples ``eos_token_id`` instead of the default token.
    ``token_fn`` overrides the default token entirely. ``fail_steps`` makes those step ids
    return an error result without advancing anything. ``max_num_seqs`` and
    ``max_num_batched_tokens``, when given, are checked against every plan.
    """

    block_size: int
    num_blocks: int | None = None
    eos_token_id: int = 0
    eos_at: dict[str, int] = field(default_factory=dict)
    token_fn: Callable[[str, int], int] | None = None
    fail_steps: set[int] = field(default_factory=set)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        self.state: dict[str, _State] = {}
        self.block_owner: dict[int, str] = {}
        self.last_step_id = 0
        self.plans: list[StepPlan] = []
        # step id -> {request id: tokens scheduled}
        self.scheduled: list[dict[str, int]] = []

    def token_for(self, request_id: str, position: int) -> int:
        if self.eos_at.get(request_id) == position:
            return self.eos_token_id
        if self.token_fn is not None:
            return self.token_fn(request_id, position)
        return default_token(request_id, position)

    def expected_outputs(self, request_id: str, prompt_len: int, n: int) -> list[int]:
        """The first ``n`` outputs this worker produces for a request run alone."""
        return [self.token_for(request_id, prompt_len + i) for i in range(n)]

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step_id > self.last_step_id, f"step id {plan.step_id} not increasing"
        self.last_step_id = plan.step_id
        self.plans.append(plan)

        for rid in plan.finished_request_ids:
            assert rid in self.state, f"finished id {rid!r} is not held by the worker"
            self._drop(rid)

        ids_in_plan = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.cached_requests]
        assert ids_in_plan, "empty plan"
        assert len(set(ids_in_plan)) == len(ids_in_plan), f"a request appears twice in step {plan.step_id}"
        if self.max_num_seqs is not None:
            assert len(ids_in_plan) <= self.max_num_seqs
        total = sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(
            r.num_scheduled_tokens for r in plan.cached_requests
        )
        if self.max_num_batched_tokens is not None:
            assert total <= self.max_num_batched_tokens, f"{total} tokens over budget"

        work: list[tuple[str, int]] = []
        for new in plan.new_requests:
            rid = new.request_id
            assert rid not in self.state, f"new request {rid!r} is already held"
            assert new.num_computed_tokens == 0, "no prefix caching yet: new requests start at 0"
            assert new.token_ids, f"{rid!r} has no tokens"
            self._claim(rid, new.block_ids)
            self.state[rid] = _State(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            work.append((rid, new.num_scheduled_tokens))
        for cached in plan.cached_requests:
            rid = cached.request_id
            assert rid in self.state, f"cached request {rid!r} is not held"
            st = self.state[rid]
            assert cached.num_computed_tokens == st.computed, (
                f"{rid!r}: plan says {cached.num_computed_tokens} computed, worker has {st.computed}"
            )
            self._claim(rid, cached.new_block_ids)
            st.blocks.extend(cached.new_block_ids)
            work.append((rid, cached.num_scheduled_tokens))

        self.scheduled.append(dict(work))
        if plan.step_id in self.fail_steps:
            # Fails after taking the plan's requests in (so the scheduler's later
            # finished_request_ids name requests it holds) but before advancing any.
            return StepResult(plan.step_id, [], [], error=f"injected failure at step {plan.step_id}")
        request_ids: list[str] = []
        sampled: list[int] = []
        for rid, n in work:
            st = self.state[rid]
            assert n >= 1, f"{rid!r}: {n} tokens scheduled"
            assert st.computed + n <= len(st.tokens), (
                f"{rid!r}: {st.computed} + {n} scheduled > {len(st.tokens)} known tokens"
            )
            assert len(st.blocks) * self.block_size >= st.computed + n, (
                f"{rid!r}: {len(st.blocks)} blocks do not cover {st.computed + n} tokens"
            )
            st.computed += n
            if st.computed == len(st.tokens):
                token = self.token_for(rid, len(st.tokens))
                st.tokens.append(token)
                request_ids.append(rid)
                sampled.append(token)
        return StepResult(plan.step_id, request_ids, sampled)

    def _claim(self, rid: str, blocks: list[int]) -> None:
        assert len(set(blocks)) == len(blocks), f"{rid!r} given a block twice: {blocks}"
        for b in blocks:
            if self.num_blocks is not None:
                assert 0 <= b < self.num_blocks, f"block {b} outside the cache"
            owner = self.block_owner.get(b)
            assert owner is None, f"block {b} given to {rid!r} while {owner!r} holds it"
            self.block_owner[b] = rid

    def _drop(self, rid: str) -> None:
        for b in self.state.pop(rid).blocks:
            del self.block_owner[b]
