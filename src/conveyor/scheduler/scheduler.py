"""The continuous batcher: forms each iteration's plan and applies the worker's result.

Pure logic, no I/O and no torch: :mod:`conveyor.scheduler.main` feeds it messages and
moves plans and results over sockets; tests drive it with a fake worker. This module holds
the protocol with its caller and the skeleton of an iteration; the state every phase receives
is one object, :class:`~conveyor.scheduler.state.SchedulerState`, and each phase lives in a
module of its own:

- :mod:`~conveyor.scheduler.state`: the shared state, finishing a request, slots given and
  taken back, and the plans in flight (:class:`~conveyor.scheduler.state.PlansInFlight`);
- :mod:`~conveyor.scheduler.step`: the plan under construction (and in flight);
- :mod:`~conveyor.scheduler.planning`: phase 1 (decodes) and phase 2 (prompts by rank);
- :mod:`~conveyor.scheduler.admission`: refusal at arrival, the admission gate, admitting;
- :mod:`~conveyor.scheduler.preemption`: the one place running requests yield their KV;
- :mod:`~conveyor.scheduler.results`: applying a worker's result (tokens, stops, outputs);
- :mod:`~conveyor.scheduler.invariants`: the invariants below, asserted for tests.

Decisions come from :mod:`~conveyor.scheduler.policy`; blocks, prefix cache and swaps are
bookkept by :mod:`~conveyor.scheduler.kv_manager`; the waiting line is
:mod:`~conveyor.scheduler.queue`, the running batch :mod:`~conveyor.scheduler.request_table`.

Protocol with the caller, at most two plans in flight::

    add_request(...) / abort(...)        any time, also between schedule() and update()
    plan = schedule()                    None when nothing can run
    take_outputs()                       outputs produced outside update() (queue timeouts)
    result = <worker executes plan>
    outputs = update(plan, result)       results are applied in plan order

**Planning ahead (overlap).** A plan counts as run the moment it is formed: each of its
requests advances ``num_computed_tokens`` by what it scheduled, and :meth:`update` later
appends the tokens sampled. So a request's token count may run ahead of its known tokens:
``num_computed_tokens + 1 - len(token_ids)`` (when positive) tokens are *pending*, sampled by
plans in flight and not back yet. With plan N in flight, :meth:`schedule` can already form
plan N+1, the worker running it right after N (the worker keeps every request's tokens and
feeds the token it sampled at N as the input of N+1). Such a plan *ahead* never preempts
(the victim's token from N would be lost) and never schedules a request that will end by
length at N; when it would have to preempt it stops there and :attr:`can_plan_ahead` turns
false, so the caller applies N and plans the next step with everything known. A request that turns
out to finish at N (a stop token) was still scheduled in N+1: its blocks and slot are freed when N
is applied, the worker drops it with the next plan's ``finished_slots``, and the token N+1 sampled
for it is discarded. Outputs are the same as without planning ahead; only decisions that depend on
N's tokens (who finished, freeing slots and blocks) come one step later.

Each iteration, within the token budget ``max_num_batched_tokens``:

1. **Decodes first.** Every running request with one token to run gets it, best rank first.
   One that needs a new block and finds none preempts the worst-ranked running request
   (itself, if it is the worst). So however long the prompts being prefilled, running
   decodes advance every iteration.
2. **Then prompts, by rank.** Running requests still prefilling, and waiting requests, take
   the rest of the budget in rank order: whichever of the next prefilling request and the
   head of the waiting queue ranks better goes next. A prefill chunk is cut to the budget
   and to the blocks available (preempting worse-ranked requests only if not one token fits).
   A waiting request is admitted when a slot (``max_num_seqs``) and blocks for all its known
   tokens are free, after its prefix-cache hit; under the priority policy it may preempt
   worse-ranked running requests to get them. One that does not fit is stepped over a
   bounded number of times (see the policy), and admissions stop when no slot is left.

Preempting a request drops or swaps out its KV (policy), lists its slot in the plan's
``finished_slots``, and requeues it under its old rank. A swapped request comes back
as NewRequestData with its computed count intact and its blocks swapped in by the same plan.

Blocks are freed the moment a request ends (finish, abort, error, preemption), also while
plans that use them are in flight. That is safe because the worker runs plans strictly in
order: a freed block can only be handed to someone else by a plan formed after the free,
which runs after every plan that still writes or reads it; its ``finished_slots``
tell the worker to drop the old owner first, and its swap-outs run before anything writes.
The same order makes a block registered in the prefix cache while the plan computing it is
in flight safe to share: whoever reads it runs later.

**Slots.** Plans and results name requests by *slot*, a small integer in
``0 .. max_num_seqs - 1``, not by id: a plan's per-request columns and the result are then
int32 arrays the codec carries as raw bytes. The scheduler keeps the free slots. A request
takes one when it is sent as NewRequestData (admission, or resumption after a preemption) and
gives it back when it is queued for the worker to drop (finish, abort, error, preemption):
at that moment the slot joins both the free list and ``_finished_slots``, which the next plan
formed carries as ``finished_slots``. Only running requests hold slots, so ``max_num_seqs``
slots always suffice. Reuse is safe for the same reason block reuse is, plus one rule of the
worker: within a plan it drops ``finished_slots`` before it takes in ``new_requests``.

- A slot given back is handed out again only by a plan formed after that, which is the
  plan that carries the drop or a later one; so the worker always drops the old owner
  before it takes in the new one (in the same plan, by the rule above).
- Plans formed before the give-back and still in flight (at most two: a retirement by
  plan N's result leaves the plan formed ahead of N in flight; an abort may come while
  both are) run before the plan carrying the drop, and name the old owner on that slot,
  which the worker still holds then. What they sample for it is
  dropped: the old owner is no longer running when their results are applied, and a
  result is matched to the requests *its* plan scheduled, never to the slot's later owner.
- Preemption happens only in a plan formed with nothing in flight, and takes the victim
  out of that plan's rows before giving its slot back; a request admitted in the plan may
  take the slot, the worker dropping the victim first. A request admitted in a plan is
  never preempted by the same plan, so a plan never both adds and drops one slot's owner
  in that order.
- So a request running when a plan's result is applied has the slot it had when the plan
  was formed (no preemption happens in between, and a finished request never runs again):
  :meth:`update` reads the result by the plan's requests' slots.
- If a step fails, the plan formed ahead of it is failed by the worker unrun, having only
  dropped its ``finished_slots``: the slots it would have given to new requests stay
  empty there, the scheduler fails those requests, and their slots, given back, reach the
  worker as drops of slots it does not hold, which it ignores.

Cost per iteration is O(running requests + tokens of newly admitted requests) plus
O(log waiting) per admission; nothing iterates over the waiting queue beyond the requests
considered for admission, nor over finished ones. The O(running requests) part is numpy
work over the slots (:mod:`~conveyor.scheduler.slot_columns`): phase 1 plans the decodes
with a few vector operations per run of decodes that fit (one run unless someone must be
preempted), and :meth:`update` applies every sampled token the same way; Python visits only
the requests that need a decision.
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
