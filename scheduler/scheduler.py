"""The continuous batcher: forms each iteration's plan and applies the worker's result.

Pure logic, no I/O and no torch: :mod:`conveyor.scheduler.main` feeds it messages and
moves plans and results over sockets; tests drive it with a fake worker.

Protocol with the caller, one plan in flight at a time::

    add_request(...) / abort(...)        any time, also between schedule() and update()
    plan = schedule()                    None when nothing can run
    result = <worker executes plan>
    outputs = update(plan, result)

Each iteration (token-centric, iteration-level batching):

1. Running requests, oldest admission first, get their next tokens within the token
   budget ``max_num_batched_tokens``: one for a decode, the rest of the prompt (cut to the
   budget) for an unfinished prefill. Each one's block table grows to cover
   ``num_computed + num_scheduled`` tokens. When not even one more token fits, the policy's
   victim (the newest running request) is preempted: its blocks are freed, it forgets its
   computed tokens but keeps its outputs, and goes back to the front of the waiting
   queue; if the victim is the request that needed the block, it simply stops there.
   A prefill chunk that fits only partly is shrunk to the blocks available rather than
   preempting anyone.
2. If nobody was preempted, waiting requests are admitted in policy order while
   ``max_num_seqs``, the budget and the free blocks allow; a prompt longer than the
   remaining budget is chunked. The first one that may not start stops admission.

Blocks are freed the moment a request ends (finish, abort, error, preemption). That is
safe while the worker runs a step because the next plan, the only thing that can hand
those blocks to someone else, is formed after that step's result has come back; its
``finished_request_ids`` tell the worker to drop the old owner first.

Cost per iteration is O(running requests + tokens of newly admitted requests); nothing
iterates over waiting requests beyond the ones admitted, nor over finished ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from conveyor.common.config import SchedulerConfig
from conveyor.common.messages import (
    AddRequest,
    CachedRequestData,
    FinishReason,
    NewRequestData,
    RequestOutput,
    StepPlan,
    StepResult,
)
from conveyor.scheduler.block_pool import BlockPool
from conveyor.scheduler.policy import FcfsPolicy, StaticBatchPolicy, blocks_for
from conveyor.scheduler.request import Request, RequestStatus

log = logging.getLogger("conveyor.scheduler")

RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Owns every live request, the block pool, and the order in which work runs.

    Invariants between calls (checked by :meth:`check_invariants`):
    - every live request is either in ``_running`` (RUNNING) or in the policy's waiting
      queue (WAITING/PREEMPTED), never both; ``_live`` maps their ids to them;
    - only running requests hold blocks, and the pool's held count is the sum of theirs;
    - ``len(_running) <= max_num_seqs``; ``_running`` is in admission order;
    - each running request's blocks cover its computed tokens, and it has at least one
      uncomputed token (``num_computed_tokens`` only advances in :meth:`update`).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Iterable[int],
        vocab_size: int | None = None,
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.pool = BlockPool(config.num_blocks)
        policy_cls = StaticBatchPolicy if config.batching == "static" else FcfsPolicy
        self.policy = policy_cls(config.block_size)
        self._live: dict[str, Request] = {}
        self._running: list[Request] = []
        # Ids the worker holds state for and must drop; sent with the next plan.
        self._finished_ids: list[str] = []
        # The plan in flight and what it scheduled, in plan order.
        self._inflight_plan: StepPlan | None = None
        self._inflight: list[tuple[Request, int]] = []
        self._num_steps = 0
        self._num_preemptions = 0

    # ------------------------------------------------------------------ intake

    def add_request(self, msg: AddRequest) -> RequestOutput | None:
        """Queue a request, or return its error output if it could never be served."""
        problem = self._rejection_reason(msg)
        if problem is not None:
            return RequestOutput(msg.request_id, [], FinishReason.ERROR, error=problem)
        req = Request.from_message(msg)
        self._live[req.request_id] = req
        self.policy.enqueue(req)
        return None

    def _rejection_reason(self, msg: AddRequest) -> str | None:
        cfg = self.config
        prompt = msg.prompt_token_ids
        max_tokens = msg.sampling.max_tokens
        if msg.request_id in self._live:
            return f"request id {msg.request_id!r} is already in use by a live request"
        if not prompt:
            return "prompt is empty"
        if max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}"
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
            bad = lo if lo < 0 else hi
            return f"prompt token id {bad} is outside the vocabulary (size {self.vocab_size})"
        total = len(prompt) + max_tokens
        if total > cfg.max_model_len:
            return (
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len ({cfg.max_model_len})"
            )
        # Conservative by one token (the last sampled token never needs a KV slot), so
        # that "fits" reads simply as "its whole length fits in the pool".
        needed = blocks_for(total, cfg.block_size)
        if needed > self.pool.total:
            return (
                f"prompt + max_tokens = {total} tokens need {needed} KV blocks of "
                f"{cfg.block_size}, but the pool has only {self.pool.total}"
            )
        return None

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish live requests with "abort" and free their blocks now; unknown ids are ignored.

        A request in the plan in flight is only marked finished; :meth:`update` drops
        whatever the worker sampled for it.
        """
        outputs = []
        for rid in request_ids:
            req = self._live.get(rid)
            if req is None:
                continue
            if req.status is RUNNING:
                self._running.remove(req)
            else:
                self.policy.remove(req)
            outputs.append(self._finish(req, FinishReason.ABORT))
        return outputs

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        """Form the next iteration's plan; None when nothing can run.

        ``finished_request_ids`` pending when None is returned stay pending for the next
        plan (the worker's leftover state is harmless until then).
        """
        if self._inflight_plan is not None:
            raise RuntimeError("schedule() called again before update() of the plan in flight")
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        running = self._running
        may_admit = self.policy.may_admit_into(len(running))
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            want = min(req.num_uncomputed_tokens, budget)
            n = self._tokens_that_fit(req, want)
            while n < 1:
                victim = running.pop(self.policy.pick_victim(running, i))
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                n = self._tokens_that_fit(req, want)
            if req.status is not RUNNING:
                break  # it was the newest and preempted itself; nothing after it
            new_blocks = self._grow(req, n)
            cached_reqs.append(CachedRequestData(req.request_id, new_blocks, req.num_computed_tokens, n))
            scheduled.append((req, n))
            budget -= n
            i += 1

        if may_admit and not preempted:
            now = time.time()
            self.policy.batch_started()
            while budget > 0 and len(running) < cfg.max_num_seqs:
                req = self.policy.peek()
                if req is None or not self.policy.can_admit(req, self.pool.num_free):
                    break
                self.policy.pop()
                n = min(req.num_uncomputed_tokens, budget)
                self._grow(req, n)
                self.policy.reserve_for_batch(req)
                req.status = RUNNING
                if req.scheduled_time is None:
                    req.scheduled_time = now
                running.append(req)
                req.worker_has_state = True
                new_reqs.append(
                    NewRequestData(
                        req.request_id,
                        req.all_token_ids,
                        req.sampling,
                        list(req.block_ids),
                        req.num_computed_tokens,
                        n,
                    )
                )
                scheduled.append((req, n))
                budget -= n

        if not scheduled:
            return None
        self._num_steps += 1
        plan = StepPlan(self._num_steps, new_reqs, cached_reqs, self._finished_ids)
        self._finished_ids = []
        self._inflight_plan = plan
        self._inflight = scheduled
        return plan

    def _tokens_that_fit(self, req: Request, want: int) -> int:
        """How many of ``want`` tokens fit in ``req``'s blocks plus the free ones."""
        capacity = (len(req.block_ids) + self.pool.num_free) * self.config.block_size
        return min(want, capacity - req.num_computed_tokens)

    def _grow(self, req: Request, n: int) -> list[int]:
        """Extend ``req``'s block table to cover ``num_computed + n`` tokens; the new blocks."""
        needed = blocks_for(req.num_computed_tokens + n, self.config.block_size) - len(req.block_ids)
        if needed <= 0:
            return []
        new_blocks = self.pool.allocate(needed)
        req.block_ids.extend(new_blocks)
        return new_blocks

    def _preempt(self, req: Request) -> None:
        """Drop ``req``'s KV (recompute later from prompt + outputs); caller removed it from running."""
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.policy.requeue_preempted(req)
        self._num_preemptions += 1

    # ------------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply the worker's result for ``plan``: advance, append tokens, retire finished ones.

        Returns one output per request that got a token or finished. Every output of a
        request repeats its timing fields (each set once), so a consumer may read them
        from whichever output it sees first. A result with ``error`` set, or malformed,
        fails every still-live request of the plan; a request due a token that the
        result lacks fails alone. Tokens for requests aborted during the step are dropped.
        """
        if plan is not self._inflight_plan:
            raise ValueError(f"update() for step {plan.step_id}, which is not the plan in flight")
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} for plan of step {plan.step_id}")
        scheduled = self._inflight
        self._inflight_plan = None
        self._inflight = []

        error = result.error
        if error is None and len(result.request_ids) != len(result.sampled_token_ids):
            error = (
                f"malformed step result: {len(result.request_ids)} request ids but "
                f"{len(result.sampled_token_ids)} tokens"
            )
        outputs: list[RequestOutput] = []
        if error is not None:
            for req, _ in scheduled:
                if req.status is RUNNING:  # not aborted while the step ran
                    outputs.append(self._finish(req, FinishReason.ERROR, error=error))
            self._running = [r for r in self._running if r.status is RUNNING]
            return outputs

        sampled = dict(zip(result.request_ids, result.sampled_token_ids))
        now = time.time()
        any_finished = False
        for req, n in scheduled:
            if req.status is not RUNNING:
                continue  # aborted while the step ran: its blocks are already free
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that does not end the prompt samples nothing
            token = sampled.get(req.request_id)
            if token is None:
                any_finished = True
                outputs.append(
                    self._finish(req, FinishReason.ERROR, error=f"worker sampled no token for {req.request_id!r}")
                )
                continue
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._stop_reason(req, token)
            if reason is None:
                outputs.append(
                    RequestOutput(req.request_id, [token], None, None, req.scheduled_time, req.first_token_time)
                )
            else:
                any_finished = True
                outputs.append(self._finish(req, reason, new_token_ids=[token]))
        if any_finished:
            self._running = [r for r in self._running if r.status is RUNNING]
        return outputs

    def _stop_reason(self, req: Request, token: int) -> str | None:
        """Stop conditions after appending ``token``, in order of precedence."""
        sp = req.sampling
        if token in self.eos_token_ids and not sp.ignore_eos:
            return FinishReason.STOP
        if token in sp.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= sp.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------------ retirement

    def _release(self, req: Request) -> None:
        """Free ``req``'s blocks and tell the worker to forget it."""
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        if req.worker_has_state:
            self._finished_ids.append(req.request_id)
            req.worker_has_state = False

    def _finish(
        self,
        req: Request,
        reason: str,
        *,
        error: str | None = None,
        new_token_ids: list[int] | None = None,
    ) -> RequestOutput:
        """Retire ``req`` (caller removes it from running/waiting) and build its last output."""
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._live[req.request_id]
        return RequestOutput(
            req.request_id,
            new_token_ids if new_token_ids is not None else [],
            reason,
            error,
            req.scheduled_time,
            req.first_token_time,
        )

    # ------------------------------------------------------------------ introspection

    def has_work(self) -> bool:
        """Whether any request is live; then :meth:`schedule` returns a plan."""
        return bool(self._live)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id (for tests and debugging)."""
        return self._live.get(request_id)

    def stats(self) -> dict[str, int]:
        """The fields of :class:`SchedulerStats` except ``query_id``."""
        return {
            "total_blocks": self.pool.total,
            "free_blocks": self.pool.num_free,
            "held_blocks": self.pool.num_held,
            "num_running": len(self._running),
            "num_waiting": len(self.policy),
            "num_steps": self._num_steps,
            "num_preemptions": self._num_preemptions,
        }

    def check_invariants(self) -> None:
        """Assert the invariants in the class docstring; O(all live requests), for tests."""
        self.pool.check_invariants()
        cfg = self.config
        running_ids = [r.request_id for r in self._running]
        waiting = list(self.policy)
        waiting_ids = [r.request_id for r in waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is running twice"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self._live), "live map out of sync"
        assert len(self._running) <= cfg.max_num_seqs
        held = 0
        seen_blocks: set[int] = set()
        for r in self._running:
            assert r.status is RUNNING and self._live[r.request_id] is r
            assert r.worker_has_state
            assert len(r.block_ids) * cfg.block_size >= r.num_computed_tokens
            assert r.num_computed_tokens < r.num_tokens, f"{r.request_id} has nothing to run"
            assert not seen_blocks.intersection(r.block_ids), "a block is held by two requests"
            seen_blocks.update(r.block_ids)
            held += len(r.block_ids)
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert self._live[r.request_id] is r
            assert not r.block_ids and r.num_computed_tokens == 0 and not r.worker_has_state
        assert held == self.pool.num_held, f"requests hold {held} blocks, pool says {self.pool.num_held}"
        for rid in self._finished_ids:
            live = self._live.get(rid)
            assert live is None or not live.worker_has_state, f"{rid} both finished and held"
