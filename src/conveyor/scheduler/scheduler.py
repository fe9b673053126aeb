"""The continuous batcher: forms each iteration's plan and applies the worker's result.

Pure logic, no I/O and no torch (:mod:`conveyor.scheduler.main` moves plans and results over
sockets; tests drive it with a fake worker). This module holds the protocol with its caller
and the iteration's skeleton; each phase is a module of its own over one
:class:`~conveyor.scheduler.state.SchedulerState`. The rules (planning ahead, decodes first,
prompts by rank, preemption, when blocks and slots are freed and reused) are in
docs/architecture.md, "The scheduler's iteration".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from conveyor.ipc.messages import (
    MAX_SLOTS,
    AddRequest,
    FinishReason,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenOutputs,
)
from conveyor.runtime.config import Preemption, SchedulerConfig
from conveyor.scheduler import invariants
from conveyor.scheduler.admission import admission_open, rejection_reason
from conveyor.scheduler.groups import release_held
from conveyor.scheduler.iteration_log import ITERATION_FIELDS, IterationLog
from conveyor.scheduler.planning import plan_decodes, plan_prompts
from conveyor.scheduler.request import RequestStatus, SchedulerRequest, SeqGroup
from conveyor.scheduler.results import apply_result
from conveyor.scheduler.speculation import plan_speculation
from conveyor.scheduler.speculation import quiet as speculation_quiet
from conveyor.scheduler.state import MAX_PLANS_IN_FLIGHT, SchedulerState
from conveyor.scheduler.step import Step

RUNNING = RequestStatus.RUNNING
SWAPPED = RequestStatus.SWAPPED
FINISHED = RequestStatus.FINISHED


class Scheduler:
    """Owns every live request, the KV block bookkeeping, and the order in which work runs.

    Invariants between calls (asserted by :meth:`check_invariants`):
    - every live request is either in the running batch (RUNNING) or in the waiting queue
      (WAITING / PREEMPTED / SWAPPED), never both; the table maps their ids to them;
    - GPU block reference counts equal the number of block tables (running requests, and
      swapped ones for the shared blocks they kept) naming each block; CPU ones the
      swapped requests plus the plan's step holds; every block is free, cached or held;
    - the running batch has at most ``max_num_seqs`` members, in rank order;
    - slots (module docstring): each running request holds one, all distinct, nobody else
      holds one; the free slots are exactly the others, so held + free = ``max_num_seqs``;
      the slots queued for the next plan's ``finished_slots`` are free (only a plan formed
      later, after the worker has dropped them, may hand them out again); a request still
      running in a plan in flight has the slot that plan names it by;
    - each running request's blocks cover its computed tokens, and it has a token to run
      (``num_computed_tokens`` advances when a plan is formed): with no plan in flight,
      ``num_computed_tokens < len(token_ids)``; a plan in flight may compute one more
      (a pending token, see the module docstring), so at most ``len(token_ids) - 1 +``
      the number of plans in flight.

    The state lives in one object, ``state`` (:class:`~conveyor.scheduler.state.SchedulerState`),
    which the phase modules receive: the queue, the running batch, the KV bookkeeping, the
    slots and their columns, the plans in flight. The scheduler itself keeps only what its
    caller sees (counters, the iteration log, outputs made outside :meth:`update`).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Iterable[int],
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if config.max_num_seqs > MAX_SLOTS:
            raise ValueError(f"max_num_seqs {config.max_num_seqs} exceeds the {MAX_SLOTS} slots a worker accepts")
        self.config = config
        self.state = SchedulerState.new(config, frozenset(eos_token_ids), vocab_size, clock)
        self.clock = clock
        self._t0 = clock()
        self.iterations = IterationLog(config.iteration_log_size)
        self._outbox: list[RequestOutput] = []  # outputs made outside update() (timeouts)
        self._seq = 0
        self._num_steps = 0
        self._num_planned_ahead = 0
        self._num_overloaded = 0
        self._num_timed_out = 0
        # LoRA adapter name -> the root of its prefix-cache chains (prefix_index: negative, never
        # reused, so an adapter loaded again under an old name never meets the old one's blocks).
        self._lora_roots: dict[str, int] = {}
        self._num_loras_added = 0
        for name in config.lora_names:
            self.add_lora(name)

    # ------------------------------------------------------------------ intake

    def add_request(self, msg: AddRequest) -> RequestOutput | None:
        """Queue a request, or return its error output if it cannot be served."""
        cfg = self.config
        req = SchedulerRequest.from_message(msg, self.state.eos_token_ids, cfg.max_model_len)
        if req.lora is not None:
            root = self._lora_roots.get(req.lora)
            if root is None:
                return RequestOutput(msg.request_id, [], FinishReason.ERROR, error=f"unknown LoRA adapter {req.lora!r}")
            req.prefix_root = root  # (its own prefix-cache chains)
        problem = rejection_reason(self.state, req)
        if problem is not None:
            return RequestOutput(msg.request_id, [], FinishReason.ERROR, error=problem)
        if cfg.max_waiting and len(self.state.queue) >= cfg.max_waiting:
            self._num_overloaded += 1
            return RequestOutput(
                msg.request_id,
                [],
                FinishReason.ERROR,
                error=f"overloaded: {len(self.state.queue)} requests are waiting (max_waiting {cfg.max_waiting}); "
                "retry later",
            )
        now = self.clock()
        req.enqueue_time = now
        self._seq += 1
        req.rank = self.state.policy.rank(msg.priority, self._seq, now - self._t0)
        if req.sampling.n > 1:  # parallel sampling: its sequences (scheduler/groups.py)
            group = SeqGroup.fan_out(req, req.sampling.n)
            self.state.groups[req.request_id] = group
            self.state.forking.append(group)
            for seq in group.seqs:
                self.state.table.add(seq)
            req = group.leader
        else:
            self.state.table.add(req)
        self.state.queue.push(req, track_timeout=cfg.max_queue_time > 0)
        return None

    @property
    def lora_names(self) -> list[str]:
        """The adapters requests may name, in the order they were added."""
        return list(self._lora_roots)

    def add_lora(self, name: str) -> None:
        """Accept requests for the LoRA adapter ``name`` (the worker holds it); ValueError if known."""
        if name in self._lora_roots:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        self._num_loras_added += 1
        self._lora_roots[name] = -self._num_loras_added

    def remove_lora(self, name: str) -> None:
        """Refuse further requests for adapter ``name``; ValueError if it is unknown or a live
        request still runs or waits under it (abort those first)."""
        if name not in self._lora_roots:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        live = [r.request_id for r in self.state.table.live.values() if r.lora == name and r.status is not FINISHED]
        if live:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(live)} live request(s)")
        del self._lora_roots[name]

    def drop_prefix_cache(self) -> None:
        """Forget the prefix cache, on the device and in the swap space (new weights, a KV cache
        freed by sleep). Only between requests: ValueError while any request holds blocks."""
        kv = self.state.kv
        if kv.gpu.num_held or (kv.swap.pool is not None and kv.swap.pool.num_held):
            raise ValueError("the prefix cache can be dropped only while no request holds KV blocks")
        kv.gpu.drop_cached()
        if kv.swap.pool is not None:
            kv.swap.pool.drop_cached()

    def abort(self, request_ids: Iterable[str], error: str | None = None) -> list[RequestOutput]:
        """Finish live requests with "abort" (with ``error``: "error", that text) and free their
        blocks now; unknown ids are ignored. A parallel-sampling request's id aborts all its
        live sequences; a sequence id, that one.

        A request in the plan in flight is only marked finished; :meth:`update` drops
        whatever the worker sampled for it.
        """
        outputs = []
        for rid in request_ids:
            group = self.state.groups.get(rid)
            reqs = [self.state.table.get(rid)] if group is None else [r for r in group.seqs if r.status is not FINISHED]
            for req in reqs:
                if req is None:
                    continue
                if req.status is RUNNING:
                    self.state.table.stop_running(req)
                else:
                    self.state.queue.remove(req)  # (a held sequence is not queued)
                reason = FinishReason.ABORT if error is None else FinishReason.ERROR
                outputs.append(self.state.finish(req, reason, error=error))
        return outputs

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs produced by :meth:`schedule` (requests that timed out in the queue)."""
        out, self._outbox = self._outbox, []
        return out

    def _expire(self, now: float) -> None:
        """Fail the never-admitted requests that waited longer than ``max_queue_time``."""
        limit = self.config.max_queue_time
        if not limit:
            return
        for req in self.state.queue.pop_expired(now - limit):
            self._num_timed_out += 1
            self._outbox.append(
                self.state.finish(
                    req, FinishReason.ERROR, error=f"timeout: not scheduled within max_queue_time ({limit:g} s)"
                )
            )

    # ------------------------------------------------------------------ one iteration

    def schedule(self) -> StepPlan | None:
        """Form the next iteration's plan; None when nothing can run.

        With a plan in flight this plans ahead (module docstring): call it only while
        :attr:`can_plan_ahead`. ``finished_slots`` and swap copies pending when None
        is returned stay pending for the next plan (the worker's leftover state is harmless
        until then).
        """
        st = self.state
        if len(st.inflight) >= MAX_PLANS_IN_FLIGHT:
            raise RuntimeError(f"schedule() with {len(st.inflight)} plans in flight: update() the oldest first")
        st.ahead = bool(st.inflight)
        st.declined = False
        started = time.perf_counter()
        now = self.clock()
        self._expire(now)
        step = Step(self.config.max_num_batched_tokens)
        num_running_at_start = len(st.table.running)
        prefills: list[SchedulerRequest] = []
        if not plan_decodes(st, step, prefills):  # 1. decodes, best rank first
            st.declined = True  # someone would have to yield: only a plan in sync may decide who
            return None
        plan_speculation(st, step)  # 1b. decodes widened to verify proposals
        # 2. prefill chunks of running requests and admissions, merged by rank
        if st.forking:
            release_held(st)  # sequences of a parallel-sampling request whose prompt KV is written
        plan_prompts(st, step, prefills, admission_open(st, num_running_at_start, now), now)
        if step.is_empty:
            st.kv.swap.settle()
            return None
        self._num_steps += 1
        swap_out, swap_in = st.kv.swap.take_transfers()
        cached = step.cached_columns(st.cols)
        plan = StepPlan(self._num_steps, step.new, cached, st.finished_slots, swap_out, swap_in, st.ahead, step.copies)
        self._num_planned_ahead += st.ahead
        st.finished_slots = []
        step.commit(st.cols)
        st.inflight.add(plan, step)
        self._record(step, plan, now, started)
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> TokenOutputs:
        """Apply the worker's result for ``plan`` (the oldest in flight): fill in its sampled
        tokens, retire finished requests.

        Returns the iteration's outputs: a request's plain next token in the columns, its
        first token (with the timing fields, each set once) and its last output (repeating
        them) as :class:`RequestOutput`. A result with ``error`` set, or malformed, fails
        every still-live request of the plan; a request due a token that the result lacks
        fails alone. Tokens for requests aborted during the step are dropped.
        """
        inflight = self.state.inflight
        if inflight and plan is inflight.oldest.plan and result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} for plan of step {plan.step_id}")
        step = inflight.pop_oldest(plan)
        try:
            return apply_result(self.state, plan, step, result)
        finally:
            self.state.kv.swap.end_step()

    @property
    def can_plan_ahead(self) -> bool:
        """Whether :meth:`schedule` may form the next plan now: exactly one plan is in
        flight, it is not doomed by the failure of the plan before it (the worker would fail
        a plan planned ahead of it too), and the last plan ahead did not stop short of a
        preemption. With speculative decoding only while speculation is quiet: a decode's
        next proposal depends on how many tokens the plan in flight accepts
        (:func:`~conveyor.scheduler.speculation.quiet`)."""
        st = self.state
        inflight = st.inflight
        if len(inflight) != 1 or st.declined or inflight.oldest.step.failed:
            return False
        return not self.config.speculative_tokens or speculation_quiet(st, inflight.oldest.step)

    def _record(self, step: Step, plan: StepPlan, now: float, started: float) -> None:
        """One row of the iteration log (fields as :data:`ITERATION_FIELDS`)."""
        prefill, decode = step.prefill_tokens, step.decode_tokens
        gpu, swap = self.state.kv.gpu, self.state.kv.swap
        admitted = step.num_admitted
        self.iterations.record(
            (
                plan.step_id,
                now,
                len(step.dslots) + len(step.scheduled),
                len(step.new),
                prefill,
                decode,
                prefill + decode,
                step.context_tokens,
                admitted,
                step.wait_sum / admitted if admitted else 0.0,
                step.wait_max,
                gpu.num_free,
                gpu.num_held,
                gpu.num_cached,
                swap.num_held_by_requests,
                step.num_swap,
                step.num_recompute,
                len(plan.swap_out),
                len(plan.swap_in),
                step.hit_tokens,
                round((time.perf_counter() - started) * 1e6),
                int(plan.planned_ahead),
            )
        )

    # ------------------------------------------------------------------ introspection

    def has_work(self) -> bool:
        """Whether any request is live (:meth:`schedule` may still return None while the
        admission gate waits; :meth:`seconds_until_ready` says how long)."""
        return bool(self.state.table.live)

    def seconds_until_ready(self) -> float | None:
        """With live requests but nothing schedulable, when the admission gate or a queue
        timeout will change that (seconds from now, >= 0); None if nothing is pending."""
        now = self.clock()
        times = []
        queue = self.state.queue
        opens = self.state.policy.admission_opens_at(
            len(queue), queue.oldest_enqueue_time(self.state.policy.min_batch_size)
        )
        if opens is not None:
            times.append(opens)
        if self.config.max_queue_time:
            arrival = queue.next_timeout_arrival()
            if arrival is not None:
                times.append(arrival + self.config.max_queue_time)
        return max(0.0, min(times) - now) if times else None

    @property
    def num_running(self) -> int:
        return len(self.state.table.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, and sequences of parallel-sampling requests held for their leader."""
        return len(self.state.queue) + sum(len(g.held) for g in self.state.forking)

    def get_request(self, request_id: str) -> SchedulerRequest | None:
        """The live request with this id (for tests and debugging)."""
        return self.state.table.get(request_id)

    def stats(self) -> dict:
        """The fields of :class:`SchedulerStats` except ``query_id``."""
        gpu, swap, kv = self.state.kv.gpu, self.state.kv.swap, self.state.kv
        cpu = swap.pool
        return {
            "total_blocks": gpu.total,
            "free_blocks": gpu.num_free,
            "held_blocks": gpu.num_held,
            "num_running": len(self.state.table.running),
            "num_waiting": len(self.state.queue),
            "num_steps": self._num_steps,
            "num_planned_ahead": self._num_planned_ahead,
            "spec_num_proposals": self.state.spec_num_proposals,
            "spec_proposed_tokens": self.state.spec_proposed_tokens,
            "spec_accepted_tokens": self.state.spec_accepted_tokens,
            "spec_accepted_per_position": list(self.state.spec_accepted_per_position),
            "spec_num_steps": self.state.spec_num_steps,
            "spec_num_limited_steps": self.state.spec_num_limited_steps,
            "num_preemptions": sum(self.state.num_preemptions.values()),
            "cached_blocks": gpu.num_cached,
            "total_cpu_blocks": swap.total,
            "free_cpu_blocks": cpu.num_free if cpu else 0,
            "cached_cpu_blocks": cpu.num_cached if cpu else 0,
            "swapped_blocks": swap.num_held_by_requests,
            "num_swapped": sum(1 for r in self.state.queue if r.status is SWAPPED),
            "num_preemptions_swap": self.state.num_preemptions[Preemption.SWAP],
            "num_preemptions_recompute": self.state.num_preemptions[Preemption.RECOMPUTE],
            "num_swapped_out_blocks": swap.num_swapped_out,
            "num_swapped_in_blocks": swap.num_swapped_in,
            "prefix_cache_queried_tokens": kv.num_queried_tokens,
            "prefix_cache_hit_tokens": kv.num_hit_tokens,
            "num_overloaded": self._num_overloaded,
            "num_timed_out": self._num_timed_out,
            "iteration_token_counts": list(self.iterations.token_counts),
            "iteration_token_sum": self.iterations.token_sum,
            "iteration_fields": list(ITERATION_FIELDS),
            "recent_iterations": self.iterations.rows(),
            "lora_adapters": self.lora_names,
            "num_hung": 0,  # the process loop's liveness watch says otherwise (conveyor.scheduler.liveness)
        }

    def check_invariants(self) -> None:
        """Assert the invariants of the class docstring (:mod:`~conveyor.scheduler.invariants`;
        O(all live requests + blocks), for tests)."""
        invariants.check_invariants(self.state)
