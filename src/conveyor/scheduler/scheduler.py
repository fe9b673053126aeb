"""The continuous batcher: forms each iteration's plan and applies the worker's result.

Pure logic, no I/O and no torch: :mod:`conveyor.scheduler.main` feeds it messages and
moves plans and results over sockets; tests drive it with a fake worker. Decisions come
from :mod:`~conveyor.scheduler.policy`; blocks, prefix cache and swaps are bookkept by
:mod:`~conveyor.scheduler.kv_manager`; the waiting line is :mod:`~conveyor.scheduler.queue`.

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
feeds the token it sampled at N as the input of N+1). Such a plan *ahead* never preempts (the victim's token from N would be lost) and never
schedules a request that will end by length at N; when it would have to preempt it stops
there and :attr:`can_plan_ahead` turns false, so the caller applies N and plans the next step
with everything known. A request that turns out to finish at N (a stop token) was
still scheduled in N+1: its blocks and slot are freed when N is applied, the worker drops it
with the next plan's ``finished_slots``, and the token N+1 sampled for it is discarded. Outputs
are the same as without planning ahead; only decisions that depend on N's tokens (who
finished, freeing slots and blocks) come one step later.

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
work over the slots (:mod:`~conveyor.scheduler.slot_columns`): phase 1 plans every decode
with a few vector operations when all of them fit, and :meth:`update` applies their tokens
the same way; Python visits only the requests that need a decision.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import chain

import numpy as np

from conveyor.runtime.config import SchedulerConfig
from conveyor.ipc.messages import (
    MAX_SLOTS,
    AddRequest,
    CachedRequests,
    FinishReason,
    NewRequestData,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenOutputs,
)
from conveyor.scheduler.kv_manager import KVCacheManager
from conveyor.scheduler.metrics import ITERATION_FIELDS, IterationLog
from conveyor.scheduler.policy import BYPASS_LOOKAHEAD, SWAP, SchedulingPolicy, blocks_for
from conveyor.scheduler.queue import WaitingQueue
from conveyor.scheduler.request import Request, RequestStatus
from conveyor.scheduler.request_table import RequestTable
from conveyor.scheduler.slot_columns import ALARM, COMPUTED, EOS, GEN, KNOWN, STOP_LEN, SlotColumns

log = logging.getLogger("conveyor.scheduler")

RUNNING = RequestStatus.RUNNING
SWAPPED = RequestStatus.SWAPPED

# Outcomes of an admission attempt that scheduled nothing.
_NO_SLOT = -1
_NO_BLOCKS = -2
_HOLD = -3  # the head was preempted in this very iteration: let it wait for the next one
# What a sampled token made of its request's output.
_PLAIN, _FIRST, _FINISHED = 0, 1, 2
# Plans in flight at once: the one the worker runs and the one planned ahead.
MAX_PLANS_IN_FLIGHT = 2
_NO_ROWS = np.empty(0, np.int64)
_NO_ROWS.flags.writeable = False


class _Step:
    """What one schedule() call has planned so far.

    The plan's cached rows are the phase-1 decodes (one token each), then everything else
    that the worker already holds (prefill chunks of running requests), in that order. The
    decodes are numpy columns by slot (``dslots``, ``dcomputed``; :mod:`slot_columns`), with
    ``dgens``, the slots' generations when planned: a row whose slot's generation has
    changed by the time the result comes back no longer names the request it was planned
    for. The other rows are lists (``slots``, ``computed``, ``counts``). ``scheduled`` holds
    every request other than the decodes (prefill chunks, admissions) with its token count.
    """

    __slots__ = (
        "budget", "dslots", "dcomputed", "dgens", "_owners", "_decodes", "_row_gen", "scheduled", "new",
        "slots", "computed", "counts", "block_rows", "block_ids",
        "preempted", "num_swap", "num_recompute", "num_admitted", "wait_sum", "wait_max", "hit_tokens",
        "decode_tokens", "prefill_tokens", "context_tokens", "swapped_out", "samplers",
        "_tokens_by_request", "failed",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.dslots = self.dcomputed = self.dgens = _NO_ROWS
        self._owners: list[Request | None] | None = None  # slot -> request, when the plan was formed
        self._decodes: list[Request] | None = None
        self._row_gen: np.ndarray | None = None
        self.scheduled: list[tuple[Request, int]] = []
        self.new: list[NewRequestData] = []
        self.slots: list[int] = []
        self.computed: list[int] = []
        self.counts: list[int] = []
        self.block_rows: list[int] = []
        self.block_ids: list[list[int]] = []
        self.preempted: set[int] = set()  # id() of requests preempted in this iteration
        self.swapped_out: list[Request] = []  # of those, the ones swapped out
        self.samplers: set[int] = set()  # id() of ``scheduled`` requests whose chunk ends the prompt
        self._tokens_by_request: dict[Request, int] | None = None
        self.failed = False  # planned ahead of a plan that failed: failed with it, its result is moot
        self.num_swap = self.num_recompute = self.num_admitted = self.hit_tokens = 0
        self.decode_tokens = self.prefill_tokens = self.context_tokens = 0
        self.wait_sum = self.wait_max = 0.0

    @property
    def decodes(self) -> list[Request]:
        """The decodes' requests, in row order (built on demand: the hot paths use the columns)."""
        if self._decodes is None:
            owners = self._owners
            assert owners is not None, "decodes asked for before the plan was formed"
            self._decodes = [owners[s] for s in self.dslots.tolist()]
        return self._decodes

    def seal(self, cols: SlotColumns) -> None:
        """The plan is formed: remember who holds the decodes' slots."""
        self._owners = cols.owner.copy()

    def add_cached(self, req: Request, n: int, new_blocks: list[int]) -> None:
        """A request the worker holds runs ``n`` more tokens (not a phase-1 decode)."""
        if new_blocks:
            self.block_rows.append(len(self.dslots) + len(self.slots))
            self.block_ids.append(new_blocks)
        self.slots.append(req.slot)
        self.computed.append(req.num_computed_tokens)
        self.counts.append(n)
        self.scheduled.append((req, n))
        self.count(req, n, +1)
        self.budget -= n

    def count(self, req: Request, n: int, sign: int) -> None:
        """Keep the iteration's token counters (for the iteration log) in step with the plan."""
        if n == 1 and len(req.token_ids) - req.num_computed_tokens <= 1:  # (< 1: its input is pending)
            self.decode_tokens += sign
        else:
            self.prefill_tokens += sign * n
        self.context_tokens += sign * (req.num_computed_tokens + n)

    def tokens_of(self, req: Request, cols: SlotColumns) -> int:
        """Tokens this (formed) plan computes for ``req``, a live request; 0 if it is not in it."""
        slot = req.slot
        if slot >= 0 and len(self.dslots):
            row_gen = self._row_gen
            if row_gen is None:
                row_gen = self._row_gen = np.full(cols.num_slots, -1, np.int64)
                row_gen[self.dslots] = self.dgens
            if row_gen[slot] == cols.generation(slot):  # planned as a decode on the slot it still holds
                return 1
        by_request = self._tokens_by_request
        if by_request is None:
            by_request = self._tokens_by_request = dict(self.scheduled)  # keyed by identity
        return by_request.get(req, 0)

    def unschedule(self, req: Request) -> None:
        """Take a request preempted after it was planned back out of the plan (rare path;
        only a plan being formed, before :meth:`seal`)."""
        hits = np.flatnonzero(self.dslots == req.slot)
        if len(hits):
            row = int(hits[0])
            self.dslots = np.delete(self.dslots, row)
            self.dcomputed = np.delete(self.dcomputed, row)
            self.dgens = np.delete(self.dgens, row)
            self.budget += 1
            self.count(req, 1, -1)
        else:
            for k, (r, n) in enumerate(self.scheduled):
                if r is req:
                    del self.scheduled[k]
                    self.budget += n
                    self.count(req, n, -1)
                    break
            else:
                return
            assert req.slot not in {d.slot for d in self.new}, "a request admitted this step was preempted"
            row = len(self.dslots) + self.slots.index(req.slot)
            k = row - len(self.dslots)
            del self.slots[k], self.computed[k], self.counts[k]
        rows, blocks = [], []
        for r, b in zip(self.block_rows, self.block_ids):
            if r != row:
                rows.append(r - (r > row))
                blocks.append(b)
        self.block_rows, self.block_ids = rows, blocks


class Scheduler:
    """Owns every live request, the KV block bookkeeping, and the order in which work runs.

    Invariants between calls (checked by :meth:`check_invariants`):
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
    """

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Iterable[int],
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.clock = clock
        self._t0 = clock()
        self.policy = SchedulingPolicy(config)
        self.kv = KVCacheManager(config)
        self.pool = self.kv.gpu
        self.queue = WaitingQueue()
        self.table = RequestTable()
        self.iterations = IterationLog(config.iteration_log_size)
        self._seq = 0
        if config.max_num_seqs > MAX_SLOTS:
            raise ValueError(f"max_num_seqs {config.max_num_seqs} exceeds the {MAX_SLOTS} slots a worker accepts")
        # Free slots (module docstring), popped from the end: the lowest first, and the one
        # given back last is reused first, which keeps the worker's slot table short.
        self._free_slots: list[int] = list(range(config.max_num_seqs - 1, -1, -1))
        self._cols = SlotColumns(config.max_num_seqs, self.eos_token_ids)
        # Slots given back whose request the worker holds and must drop; sent with the next plan.
        self._finished_slots: list[int] = []
        # Outputs made outside update() (timeouts), collected by take_outputs().
        self._outbox: list[RequestOutput] = []
        # The plans in flight, oldest first, with what each scheduled.
        self._inflight: deque[tuple[StepPlan, _Step]] = deque()
        self._ahead = False  # the plan being formed is planned ahead of one in flight
        self._declined = False  # the last plan ahead stopped short of something only a plan in sync may do
        self._num_steps = 0
        self._num_planned_ahead = 0
        self._num_preemptions = {SWAP: 0, "recompute": 0}
        self._num_overloaded = 0
        self._num_timed_out = 0

    # ------------------------------------------------------------------ intake

    def add_request(self, msg: AddRequest) -> RequestOutput | None:
        """Queue a request, or return its error output if it cannot be served."""
        problem = self._rejection_reason(msg)
        if problem is not None:
            return RequestOutput(msg.request_id, [], FinishReason.ERROR, error=problem)
        cfg = self.config
        if cfg.max_waiting and len(self.queue) >= cfg.max_waiting:
            self._num_overloaded += 1
            return RequestOutput(
                msg.request_id,
                [],
                FinishReason.ERROR,
                error=f"overloaded: {len(self.queue)} requests are waiting (max_waiting {cfg.max_waiting}); retry later",
            )
        req = Request.from_message(msg, self.eos_token_ids, cfg.max_model_len)
        now = self.clock()
        req.enqueue_time = now
        self._seq += 1
        req.rank = self.policy.rank(msg.priority, self._seq, now - self._t0)
        self.table.add(req)
        self.queue.push(req, track_timeout=cfg.max_queue_time > 0)
        return None

    def _rejection_reason(self, msg: AddRequest) -> str | None:
        cfg = self.config
        prompt = msg.prompt_token_ids
        max_tokens = msg.sampling.max_tokens
        if msg.request_id in self.table.live:
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
            req = self.table.get(rid)
            if req is None:
                continue
            if req.status is RUNNING:
                self.table.stop_running(req)
            else:
                self.queue.remove(req)
            outputs.append(self._finish(req, FinishReason.ABORT))
        return outputs

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs produced by :meth:`schedule` (requests that timed out in the queue)."""
        out, self._outbox = self._outbox, []
        return out

    def _expire(self, now: float) -> None:
        limit = self.config.max_queue_time
        if not limit:
            return
        for req in self.queue.pop_expired(now - limit):
            self._num_timed_out += 1
            self._outbox.append(
                self._finish(
                    req,
                    FinishReason.ERROR,
                    error=f"timeout: not scheduled within max_queue_time ({limit:g} s)",
                )
            )

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        """Form the next iteration's plan; None when nothing can run.

        With a plan in flight this plans ahead (module docstring): call it only while
        :attr:`can_plan_ahead`. ``finished_slots`` and swap copies pending when None
        is returned stay pending for the next plan (the worker's leftover state is harmless
        until then).
        """
        if len(self._inflight) >= MAX_PLANS_IN_FLIGHT:
            raise RuntimeError(f"schedule() with {len(self._inflight)} plans in flight: update() the oldest first")
        self._ahead = bool(self._inflight)
        self._declined = False
        started = time.perf_counter()
        now = self.clock()
        self._expire(now)
        step = _Step(self.config.max_num_batched_tokens)
        running = self.table.running
        num_running_at_start = len(running)

        # 1. Decodes, best rank first; prefilling requests are set aside for phase 2.
        prefills: list[Request] = []
        if not self._plan_all_decodes(step, prefills):
            if self._ahead:  # someone would have to yield a block: only a plan in sync may decide who
                self._declined = True
                return None
            self._plan_decodes(step, prefills)

        # 2. Prefill chunks of running requests and admissions, merged by rank.
        policy = self.policy
        queue = self.queue
        admit_open = policy.may_admit_into(num_running_at_start) and self._admission_open(now)
        skipped: list[Request] = []
        reserved = 0
        k = 0
        while step.budget > 0:
            cand = None
            while k < len(prefills):
                cand = prefills[k]
                if cand.status is RUNNING:
                    break
                k += 1
                cand = None
            head = queue.peek() if admit_open else None
            if cand is None and head is None:
                break
            if head is None or (cand is not None and cand.rank < head.rank):
                k += 1
                self._schedule_prefill(step, cand)
                continue
            outcome = self._try_admit(step, head, now, reserved)
            if outcome >= 0:
                reserved += outcome
                for blocked in skipped:  # each admission behind a blocked request counts against it
                    blocked.num_bypassed += 1
                    if blocked.num_bypassed >= policy.max_bypass:
                        admit_open = False  # bound reached: nobody passes it any more
                continue
            if outcome == _NO_BLOCKS and head.num_bypassed < policy.max_bypass and len(skipped) < BYPASS_LOOKAHEAD:
                queue.pop()  # set it aside for this iteration; smaller ones behind it may start
                skipped.append(head)
            else:
                admit_open = False
        for blocked in skipped:
            queue.push(blocked)

        if not len(step.dslots) and not step.scheduled:
            self.kv.swap.settle()
            return None
        self._num_steps += 1
        swap_out, swap_in = self.kv.swap.take_transfers()
        step.seal(self._cols)
        cached = self._cached_columns(step)
        plan = StepPlan(self._num_steps, step.new, cached, self._finished_slots, swap_out, swap_in, self._ahead)
        self._num_planned_ahead += self._ahead
        self._finished_slots = []
        self._commit(step)
        self._inflight.append((plan, step))
        self._record(step, plan, now, started)
        return plan

    @property
    def can_plan_ahead(self) -> bool:
        """Whether :meth:`schedule` may form the next plan now: exactly one plan is in
        flight, it is not doomed by the failure of the plan before it (the worker would fail
        a plan planned ahead of it too), and the last plan ahead did not stop short of a
        preemption."""
        return len(self._inflight) == 1 and not self._declined and not self._inflight[0][1].failed

    def _done_tokens(self, req: Request) -> int:
        """``num_computed_tokens`` minus what the plans still in flight compute for ``req``:
        the tokens whose KV is known to be written."""
        done = req.num_computed_tokens
        for _, step in self._inflight:
            done -= step.tokens_of(req, self._cols)
        return done

    def _cached_columns(self, step: _Step) -> CachedRequests:
        """The plan's cached rows as int32 columns: the decodes, then the other rows."""
        n = len(step.dslots)
        if not step.slots:
            return CachedRequests(
                step.dslots.astype(np.int32), step.dcomputed.astype(np.int32), self._cols.ones[:n],
                step.block_rows, step.block_ids,
            )
        return CachedRequests(
            np.concatenate((step.dslots, step.slots)).astype(np.int32),
            np.concatenate((step.dcomputed, step.computed)).astype(np.int32),
            np.concatenate((np.ones(n, np.int64), step.counts)).astype(np.int32),
            step.block_rows,
            step.block_ids,
        )

    @property
    def num_plans_in_flight(self) -> int:
        return len(self._inflight)

    def _commit(self, step: _Step) -> None:
        """Count the plan as run: advance what it scheduled (the tokens it samples are
        pending until :meth:`update` appends them)."""
        self._cols.computed[step.dslots] += 1  # (slots are distinct within a plan)
        samplers = step.samplers
        for req, n in step.scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == len(req.token_ids):  # the chunk ends the prompt: it samples
                samplers.add(id(req))

    def _plan_all_decodes(self, step: _Step, prefills: list[Request]) -> bool:
        """Phase 1 when every decode fits the budget and the available blocks: nobody is
        preempted, so the rows are planned in bulk. False (nothing changed) otherwise.

        This is the steady state of a busy server and the scheduler's hottest code: numpy
        operations over the running requests' slots (:mod:`slot_columns`); Python touches
        only the requests still prefilling and those at a block boundary.
        """
        running = self.table.running
        if not running:
            return True
        cols = self._cols
        bs = self.config.block_size
        slots = self.table.running_slots()
        rows = cols.state.take(slots, axis=1)
        computed = rows[COMPUTED]
        prefilling = rows[KNOWN] - computed > 1
        if self._ahead:
            # The token pending is its last (by length): nothing more to run. In sync none is pending.
            decoding = ~prefilling & (computed < rows[STOP_LEN] - 1)
        else:
            decoding = ~prefilling
        if np.count_nonzero(prefilling):
            prefills.extend([running[i] for i in prefilling.nonzero()[0].tolist()])
            slots, rows = slots[decoding], rows[:, decoding]
        elif np.count_nonzero(decoding) < len(decoding):
            slots, rows = slots[decoding], rows[:, decoding]
        computed = rows[COMPUTED]
        # Its blocks cover its computed tokens, so it needs one only at a block boundary:
        # the cheap test in bulk, the block table only every block_size steps.
        owner = cols.owner
        boundary = (computed % bs == 0).nonzero()[0].tolist()
        need_rows = [row for row in boundary if len(owner[slots[row]].block_ids) * bs <= computed[row]]
        gpu = self.kv.gpu
        if len(slots) > step.budget or len(need_rows) > gpu.num_available:
            prefills.clear()
            return False
        if need_rows:
            fresh = gpu.allocate(len(need_rows))
            for row, block in zip(need_rows, fresh):
                owner[slots[row]].block_ids.append(block)
            step.block_rows = need_rows
            step.block_ids = [[block] for block in fresh]
        n = len(slots)
        step.dslots, step.dcomputed, step.dgens = slots, computed, rows[GEN]
        step.decode_tokens = n
        step.context_tokens = int(np.add.reduce(computed)) + n
        step.budget -= n
        return True

    def _plan_decodes(self, step: _Step, prefills: list[Request]) -> None:
        """Phase 1, one request at a time: a decode that needs a block and finds none
        preempts the worst-ranked running request (itself, if it is the worst)."""
        bs = self.config.block_size
        gpu = self.kv.gpu
        running = self.table.running
        decodes: list[Request] = []
        i = 0
        while i < len(running) and step.budget:
            req = running[i]
            if len(req.token_ids) - req.num_computed_tokens > 1:
                prefills.append(req)
                i += 1
                continue
            if req.num_computed_tokens >= len(req.block_ids) * bs:
                if gpu.num_available == 0 and not self._make_room(step, req, self_preempt=True):
                    continue  # it was the worst-ranked and yielded; running[i] is the next one
                block = gpu.allocate(1)[0]
                req.block_ids.append(block)
                step.block_rows.append(len(decodes))
                step.block_ids.append([block])
            decodes.append(req)
            step.count(req, 1, +1)
            step.budget -= 1
            i += 1
        if decodes:
            step.dslots = np.fromiter([r.slot for r in decodes], np.int64, len(decodes))
            rows = self._cols.state.take(step.dslots, axis=1)
            step.dcomputed, step.dgens = rows[COMPUTED], rows[GEN]

    def _admission_open(self, now: float) -> bool:
        queue = self.queue
        n = len(queue)
        if not n:
            return False
        oldest = queue.oldest_enqueue_time(self.policy.min_batch_size)
        return self.policy.admission_open(n, oldest, now)

    def _schedule_prefill(self, step: _Step, req: Request) -> None:
        """Give a running, still-prefilling request its next chunk, if one token fits."""
        want = min(len(req.token_ids) - req.num_computed_tokens, step.budget)
        n = self.kv.tokens_that_fit(req, want)
        while n < 1:
            victim = self.table.running[-1]
            if victim is req or victim.rank <= req.rank:
                return  # nobody below it to take blocks from: it waits, keeping its KV
            if self._ahead:
                self._declined = True
                return
            self._preempt(step, victim)
            n = self.kv.tokens_that_fit(req, want)
        new_blocks = self.kv.grow(req, req.num_computed_tokens + n)
        step.add_cached(req, n, new_blocks)

    def _make_room(self, step: _Step, req: Request, self_preempt: bool) -> bool:
        """Preempt worst-ranked running requests until a block is available for ``req``.

        False when ``req`` itself is the worst-ranked: with ``self_preempt`` it is then
        preempted (it yields rather than stall everyone), else it just does not run.
        """
        gpu = self.kv.gpu
        running = self.table.running
        while gpu.num_available == 0:
            victim = running[-1]
            if victim is req:
                if self_preempt:
                    self._preempt(step, req)
                return False
            self._preempt(step, victim)
        return True

    def _try_admit(self, step: _Step, req: Request, now: float, reserved: int) -> int:
        """Admit the queue head ``req`` if it can start: the blocks it reserves for later
        growth (>= 0), or why not (``_NO_SLOT``, ``_NO_BLOCKS``, ``_HOLD``)."""
        if id(req) in step.preempted:
            return _HOLD
        cfg = self.config
        kv = self.kv
        running = self.table.running
        reserve = self.policy.growth_reserve(req.num_prompt_tokens, req.sampling.max_tokens, len(req.token_ids))

        def need() -> tuple[int, int, object]:
            if req.status is SWAPPED:
                n, avail = kv.resume_need(req)
                return n + reserve, avail - reserved, None
            match = kv.match(req)
            n, avail = kv.admission_need(req, match)
            return n + reserve, avail - reserved, match

        needed, available, match = need()
        no_slot = len(running) >= cfg.max_num_seqs
        if no_slot or needed > available:
            if not self.policy.preempts_for_admission:
                return _NO_SLOT if no_slot else _NO_BLOCKS
            # Preempt only if all worse-ranked running requests together make it fit.
            freeable, count = 0, 0
            for victim in reversed(running):
                if victim.rank <= req.rank or (count >= no_slot and available + freeable >= needed):
                    break
                freeable += kv.exclusive_blocks(victim)
                count += 1
            if count < no_slot or available + freeable < needed:
                return _NO_SLOT if no_slot and count == 0 else _NO_BLOCKS
            if self._ahead:
                self._declined = True
                return _HOLD  # it would preempt: only a plan formed in sync may
            while len(running) >= cfg.max_num_seqs or needed > available:
                victim = running[-1]
                if victim.rank <= req.rank:
                    return _NO_BLOCKS  # the estimate counted blocks the request itself shares
                self._preempt(step, victim)
                needed, available, match = need()

        self.queue.pop()
        if req.status is SWAPPED:
            kv.resume(req)
        else:
            kv.admit(req, match)
            step.hit_tokens += req.num_computed_tokens
        n = min(len(req.token_ids) - req.num_computed_tokens, step.budget)
        kv.grow(req, req.num_computed_tokens + n)
        req.status = RUNNING
        req.num_bypassed = 0
        self.table.start_running(req)
        if req.scheduled_time is None:
            req.scheduled_time = now
            req.num_cached_tokens = req.num_computed_tokens
            waited = now - req.enqueue_time
            step.num_admitted += 1
            step.wait_sum += waited
            step.wait_max = max(step.wait_max, waited)
        self._take_slot(req)
        step.new.append(
            NewRequestData(
                req.request_id,
                req.slot,
                req.all_token_ids,
                req.sampling,
                list(req.block_ids),
                req.num_computed_tokens,
                n,
            )
        )
        step.scheduled.append((req, n))
        step.count(req, n, +1)
        step.budget -= n
        return reserve

    def _preempt(self, step: _Step, req: Request) -> None:
        """Swap out or drop ``req``'s KV and requeue it under its rank (it is running; only a
        plan formed in sync preempts, so no token of it is pending)."""
        assert req.num_computed_tokens < len(req.token_ids), f"{req.request_id} preempted with tokens pending"
        self.table.stop_running(req)
        step.unschedule(req)
        kv = self.kv
        mode = self.policy.preemption_mode(kv.blocks_to_swap(req), req.num_computed_tokens, kv.swap.num_available)
        if mode == SWAP:
            kv.swap_out(req)
            req.status = SWAPPED
            step.num_swap += 1
            step.swapped_out.append(req)
        else:
            kv.free(req)
            req.num_computed_tokens = 0
            req.num_registered_blocks = 0
            req.block_hashes = []
            req.status = RequestStatus.PREEMPTED
            step.num_recompute += 1
        self._num_preemptions[mode] += 1
        self._release_slot(req)  # after it left the plan's rows (unschedule above)
        step.preempted.add(id(req))
        self.queue.push(req)

    def _record(self, step: _Step, plan: StepPlan, now: float, started: float) -> None:
        prefill, decode, context = step.prefill_tokens, step.decode_tokens, step.context_tokens
        gpu, swap = self.kv.gpu, self.kv.swap
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
                context,
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

    # ------------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult) -> TokenOutputs:
        """Apply the worker's result for ``plan`` (the oldest in flight): fill in its sampled
        tokens, retire finished requests.

        Returns the iteration's outputs: a request's plain next token in the columns, its
        first token (with the timing fields, each set once) and its last output (repeating
        them) as :class:`RequestOutput`. A result with ``error`` set, or malformed, fails
        every still-live request of the plan; a request due a token that the result lacks
        fails alone. Tokens for requests aborted during the step are dropped.
        """
        if not self._inflight or plan is not self._inflight[0][0]:
            raise ValueError(f"update() for step {plan.step_id}, which is not the oldest plan in flight")
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} for plan of step {plan.step_id}")
        _, step = self._inflight.popleft()
        try:
            return self._apply(plan, step, result)
        finally:
            self.kv.swap.end_step()

    def _apply(self, plan: StepPlan, step: _Step, result: StepResult) -> TokenOutputs:
        error = result.error
        slots = np.asarray(result.slots, np.int64)  # numpy when decoded (scheduler/main.py copies them)
        tokens = np.asarray(result.sampled_token_ids, np.int64)
        if error is None and (slots.ndim != 1 or slots.shape != tokens.shape):
            error = f"malformed step result: {slots.size} slots but {tokens.size} tokens"
        outputs: list[RequestOutput] = []
        if step.failed:
            return TokenOutputs(outputs)  # failed with the plan it was planned ahead of
        if error is not None:
            # A plan planned ahead of this one was built on it: the worker finds it does not
            # match its state and fails it too (changing nothing but dropping finished ids).
            # Its requests fail now, and its copies are as untrustworthy as this plan's.
            failed = step.decodes + [r for r, _ in step.scheduled]
            for _, later in self._inflight:
                later.failed = True
                failed += later.decodes + [r for r, _ in later.scheduled]
            for req in failed:
                if req.status is RUNNING:  # not aborted while the step ran (nor failed just above)
                    # Nothing this plan was to compute can be trusted, nor what later ones build on it.
                    done = self._done_tokens(req) - step.tokens_of(req, self._cols)
                    outputs.append(self._finish(req, FinishReason.ERROR, error=error, done=done))
            self.table.prune_running()
            # The worker may have failed before the plan's copies ran: nothing they were to
            # fill can be trusted (also where the finishes above cached those blocks).
            # Victims swapped out by this plan fall back to recompute.
            for failed_plan in [plan] + [later_plan for later_plan, _ in self._inflight]:
                self.kv.invalidate_transfers(failed_plan.swap_out, failed_plan.swap_in)
            for req in step.swapped_out:
                if req.status is SWAPPED:
                    self.kv.free(req)
                    req.num_computed_tokens = req.num_registered_blocks = 0
                    req.block_hashes = []
                    req.status = RequestStatus.PREEMPTED
            return TokenOutputs(outputs)

        # The worker answers in plan order: new requests that sample, then the cached rows,
        # decodes first. So the decodes' tokens are one slice (checked by comparing the
        # slots); a worker answering in another order just takes the general path.
        # Requests still running have the slots this plan gave them (module docstring).
        others = step.scheduled
        samplers = step.samplers
        first = sum(1 for d in plan.new_requests if d.num_computed_tokens + d.num_scheduled_tokens == len(d.token_ids))
        last = first + len(step.dslots)
        answered = slots[first:last]
        in_order = len(answered) == len(step.dslots) and not np.count_nonzero(answered != step.dslots)
        if len(step.dslots) and not in_order:
            others = [(r, 1) for r in step.decodes] + others
            samplers = samplers | {id(r) for r in step.decodes}
            last = first  # no slice is taken: every row is mapped by slot below
        now = self.clock()
        finished: list[Request] = []  # running requests this update retires
        if last > first:
            column_ids, column_tokens = self._apply_decodes(step, tokens[first:last], outputs, finished, now)
        else:
            column_ids, column_tokens = [], []
        if others:
            if last > first:  # the decodes' slice is taken: map only the rows around it
                slot_list, token_list = slots.tolist(), tokens.tolist()
                pairs = chain(zip(slot_list[:first], token_list[:first]), zip(slot_list[last:], token_list[last:]))
            else:
                pairs = zip(slots.tolist(), tokens.tolist())
            sampled = dict(pairs).get
            cols = self._cols
            for req, _ in others:
                if req.status is not RUNNING:
                    continue  # ended while the step ran: its blocks are already free
                self.kv.register_full_blocks(req, self._done_tokens(req))
                if id(req) not in samplers:
                    continue  # a prefill chunk that does not end the prompt samples nothing
                token = sampled(req.slot)
                if token is None:
                    finished.append(req)
                    outputs.append(
                        self._finish(
                            req,
                            FinishReason.ERROR,
                            error=f"worker sampled no token for this request (slot {req.slot}, step {plan.step_id})",
                        )
                    )
                    continue
                req.token_ids.append(token)
                cols.token_appended(req.slot)
                kind = self._output(req, token, outputs, now)
                if kind == _FINISHED:
                    finished.append(req)
                elif kind == _PLAIN:
                    column_ids.append(req.request_id)
                    column_tokens.append(token)
        if finished:
            self.table.prune_running(finished)
        return TokenOutputs(outputs, column_ids, column_tokens)

    def _apply_decodes(
        self,
        step: _Step,
        tokens: np.ndarray,
        outputs: list[RequestOutput],
        finished: list[Request],
        now: float,
    ) -> tuple[list[str], list[int]]:
        """The decodes' share of :meth:`update`: one token each, in plan order; returns the
        output columns (request ids, tokens) of the plain ones.

        The hottest code of a busy server, so it works on the slot columns: the tokens are
        appended to the requests' lists in one C-level pass, and the stop tests run in bulk.
        Only rows that need a decision (a stop, a first token, a request with stop ids of
        its own, or one that ended while the step ran) go through Python. Blocks that
        decoding fills are registered in the prefix index only when the request releases
        them (:meth:`KVCacheManager.free`): nobody else could share generated tokens while
        it runs, and hashing them every step was a third of this loop.
        """
        cols = self._cols
        slots = step.dslots
        rows = cols.state.take(slots, axis=1)
        live = rows[GEN] == step.dgens  # still held by the request planned on it
        if np.count_nonzero(live) < len(live):
            slots, tokens, rows = slots[live], tokens[live], rows[:, live]
        slot_list, token_list = slots.tolist(), tokens.tolist()
        token_lists = cols.token_lists
        deque(map(list.append, map(token_lists.__getitem__, slot_list), token_list), maxlen=0)
        cols.known[slots] += 1
        unusual = rows[KNOWN] >= rows[ALARM] - 1  # (rows were read before the append)
        eos_rows = rows[EOS]
        if np.count_nonzero(eos_rows):
            unusual |= (eos_rows != 0) & cols.is_eos(tokens)
        if not np.count_nonzero(unusual):
            return cols.ids[slots].tolist(), token_list
        plain = ~unusual
        owner = cols.owner
        for row in unusual.nonzero()[0].tolist():
            req = owner[slot_list[row]]
            kind = self._output(req, token_list[row], outputs, now)
            if kind == _FINISHED:
                finished.append(req)
            elif kind == _PLAIN:  # stop ids of its own, none of them sampled
                plain[row] = True
        return cols.ids[slots[plain]].tolist(), tokens[plain].tolist()

    def _output(self, req: Request, token: int, outputs: list[RequestOutput], now: float) -> int:
        """After ``token`` was appended: finish the request (``_FINISHED``), or give its first
        token a full output (``_FIRST``); a plain later token (``_PLAIN``) is left to the
        caller's columns."""
        if token in req.stop_ids or len(req.token_ids) >= req.stop_len:
            if req.first_token_time is None:
                req.first_token_time = now
            reason = FinishReason.STOP if token in req.stop_ids else FinishReason.LENGTH
            outputs.append(self._finish(req, reason, new_token_ids=[token]))
            return _FINISHED
        if req.first_token_time is None:
            req.first_token_time = now
            self._cols.first_token_done(req)
            outputs.append(
                RequestOutput(req.request_id, [token], None, None, req.scheduled_time, now, req.num_cached_tokens)
            )
            return _FIRST
        return _PLAIN

    def stop_reason(self, req: Request, token: int) -> str | None:
        """Stop conditions after appending ``token``, in order of precedence (as :meth:`update` applies them)."""
        if token in req.stop_ids:
            return FinishReason.STOP
        if len(req.token_ids) >= req.stop_len:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------------ retirement

    def _finish(
        self,
        req: Request,
        reason: str,
        *,
        error: str | None = None,
        new_token_ids: list[int] | None = None,
        done: int | None = None,
    ) -> RequestOutput:
        """Retire ``req`` (caller removes it from running/waiting) and build its last output.

        With plans in flight, its computed count is first cut back to ``done`` (default: what
        the plans already applied computed), so that only KV known to be written goes to the
        prefix cache (and no pending token is counted)."""
        if done is not None or self._inflight:
            req.num_computed_tokens = self._done_tokens(req) if done is None else done
        self.kv.free(req)
        self._release_slot(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.table.forget(req)
        return RequestOutput(
            req.request_id,
            new_token_ids if new_token_ids is not None else [],
            reason,
            error,
            req.scheduled_time,
            req.first_token_time,
            req.num_cached_tokens,
        )

    def _take_slot(self, req: Request) -> None:
        """Give ``req`` a free slot (one exists: it is not running, and fewer than
        ``max_num_seqs`` are); its hot counters move into the slot columns."""
        slot = self._free_slots.pop()
        self._cols.assign(req, slot, eos_stops=not req.sampling.ignore_eos)
        req.columns = self._cols
        req.slot = slot

    def _release_slot(self, req: Request) -> None:
        """Give ``req``'s slot back, if it holds one: free for the next admission at once, and
        queued for the worker to drop with the next plan (which drops before it adds)."""
        slot = req.slot
        if slot >= 0:
            self._cols.release(req, slot)
            self._finished_slots.append(slot)
            self._free_slots.append(slot)
            req.slot = -1

    # ------------------------------------------------------------------ introspection

    def has_work(self) -> bool:
        """Whether any request is live (:meth:`schedule` may still return None while the
        admission gate waits; :meth:`seconds_until_ready` says how long)."""
        return bool(self.table.live)

    def seconds_until_ready(self) -> float | None:
        """With live requests but nothing schedulable, when the admission gate or a queue
        timeout will change that (seconds from now, >= 0); None if nothing is pending."""
        now = self.clock()
        times = []
        queue = self.queue
        opens = self.policy.admission_opens_at(len(queue), queue.oldest_enqueue_time(self.policy.min_batch_size))
        if opens is not None:
            times.append(opens)
        if self.config.max_queue_time:
            arrival = queue.next_timeout_arrival()
            if arrival is not None:
                times.append(arrival + self.config.max_queue_time)
        return max(0.0, min(times) - now) if times else None

    @property
    def num_running(self) -> int:
        return len(self.table.running)

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id (for tests and debugging)."""
        return self.table.get(request_id)

    def stats(self) -> dict:
        """The fields of :class:`SchedulerStats` except ``query_id``."""
        gpu, swap, kv = self.kv.gpu, self.kv.swap, self.kv
        cpu = swap.pool
        return {
            "total_blocks": gpu.total,
            "free_blocks": gpu.num_free,
            "held_blocks": gpu.num_held,
            "num_running": len(self.table.running),
            "num_waiting": len(self.queue),
            "num_steps": self._num_steps,
            "num_planned_ahead": self._num_planned_ahead,
            "num_preemptions": sum(self._num_preemptions.values()),
            "cached_blocks": gpu.num_cached,
            "total_cpu_blocks": swap.total,
            "free_cpu_blocks": cpu.num_free if cpu else 0,
            "cached_cpu_blocks": cpu.num_cached if cpu else 0,
            "swapped_blocks": swap.num_held_by_requests,
            "num_swapped": sum(1 for r in self.queue if r.status is SWAPPED),
            "num_preemptions_swap": self._num_preemptions[SWAP],
            "num_preemptions_recompute": self._num_preemptions["recompute"],
            "num_swapped_out_blocks": swap.num_swapped_out,
            "num_swapped_in_blocks": swap.num_swapped_in,
            "prefix_cache_queried_tokens": kv.num_queried_tokens,
            "prefix_cache_hit_tokens": kv.num_hit_tokens,
            "num_overloaded": self._num_overloaded,
            "num_timed_out": self._num_timed_out,
            "iteration_fields": list(ITERATION_FIELDS),
            "recent_iterations": self.iterations.rows(),
        }

    def check_invariants(self) -> None:
        """Assert the invariants in the class docstring; O(all live requests + blocks), for tests."""
        cfg = self.config
        bs = cfg.block_size
        running = self.table.running
        waiting = list(self.queue)
        running_ids = [r.request_id for r in running]
        waiting_ids = [r.request_id for r in waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is running twice"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is queued twice"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self.table.live), "live map out of sync"
        assert len(running) <= cfg.max_num_seqs
        assert all(a.rank < b.rank for a, b in zip(running, running[1:])), "running batch out of rank order"
        gpu_refs: dict[int, int] = {}
        cpu_refs: dict[int, int] = {}
        for r in running:
            assert r.status is RUNNING and self.table.live[r.request_id] is r
            assert r.slot >= 0 and not r.cpu_blocks, f"{r.request_id}: running without a slot, or with CPU blocks"
            assert len(r.block_ids) * bs >= r.num_computed_tokens
            pending = max(0, r.num_computed_tokens + 1 - r.num_tokens)
            assert pending <= len(self._inflight), f"{r.request_id}: {pending} tokens pending, or nothing to run"
            assert len(r.block_ids) <= blocks_for(r.num_tokens + pending, bs)
            assert self._done_tokens(r) <= r.num_tokens, f"{r.request_id}: KV of unknown tokens counted as done"
            assert len(set(r.block_ids)) == len(r.block_ids) and min(r.block_ids, default=0) >= 0
            for i in range(r.num_registered_blocks):
                h = self.pool.block_hash(r.block_ids[i])
                assert h is None or h == r.block_hashes[i], f"{r.request_id}: block {i} holds another prefix"
        for r in waiting:
            assert self.table.live[r.request_id] is r and r.slot == -1, f"{r.request_id} waits holding a slot"
            if r.status is SWAPPED:
                assert r.cpu_blocks, f"swapped {r.request_id} holds no KV"
                assert len(r.block_ids) == len(r.cpu_blocks) == blocks_for(r.num_computed_tokens, bs)
                assert all(b == -1 for b in r.block_ids) and [i for i, _ in r.cpu_blocks] == list(range(len(r.block_ids)))
                for _, c in r.cpu_blocks:
                    cpu_refs[c] = cpu_refs.get(c, 0) + 1
            else:
                assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                assert not r.block_ids and r.num_computed_tokens == 0 and not r.cpu_blocks
        for r in running + waiting:
            for b in r.block_ids:
                if b >= 0:
                    gpu_refs[b] = gpu_refs.get(b, 0) + 1
        self.pool.check_invariants(gpu_refs)
        swap = self.kv.swap
        registered = self.pool.registered_ids()
        if swap.pool is not None:
            for c in swap.holds():
                cpu_refs[c] = cpu_refs.get(c, 0) + 1
            swap.pool.check_invariants(cpu_refs)
            registered += swap.pool.registered_ids()
        held_ids: dict[int, int] = {}
        for content in registered:
            held_ids[content] = held_ids.get(content, 0) + 1
        self.kv.index.check(held_ids)
        for r in running:
            assert len(r.block_hashes) == r.num_registered_blocks <= r.num_computed_tokens // bs, r.request_id
        assert swap.num_held_by_requests == sum(len(r.cpu_blocks) for r in waiting)
        self._check_slots()
        self._cols.check(running)
        assert self.table.running_slots().tolist() == [r.slot for r in running], "cached running slots are stale"

    def _check_slots(self) -> None:
        """The slot invariants of the class docstring, and that every request still running in
        a plan in flight has the slot that plan names it by (what :meth:`update` relies on)."""
        n = self.config.max_num_seqs
        held = [r.slot for r in self.table.running]
        free = self._free_slots
        assert len(set(held)) == len(held), f"two running requests share a slot: {sorted(held)}"
        assert len(set(free)) == len(free), f"a slot is free twice: {sorted(free)}"
        assert not set(held) & set(free), f"slots both held and free: {sorted(set(held) & set(free))}"
        assert set(held) | set(free) == set(range(n)), "slots lost or out of range"
        # Slots given back since the last plan: no plan formed since could hand them out again.
        pending = self._finished_slots
        assert len(set(pending)) == len(pending), f"a slot is queued to be dropped twice: {pending}"
        assert set(pending) <= set(free), f"slots queued to be dropped but held: {sorted(set(pending) - set(free))}"
        for plan, step in self._inflight:
            new_slots = [d.slot for d in plan.new_requests]
            cached_slots = list(plan.cached_requests.slots)
            named = new_slots + cached_slots
            assert len(set(named)) == len(named), f"step {plan.step_id} names a slot twice"
            assert not set(cached_slots) & set(plan.finished_slots), f"step {plan.step_id} drops a slot it runs"
            slot_of_new = {d.request_id: d.slot for d in plan.new_requests}
            rows = iter(cached_slots)
            expected = [(r, next(rows)) for r in step.decodes]
            for r, _ in step.scheduled:
                expected.append((r, slot_of_new[r.request_id] if r.request_id in slot_of_new else next(rows)))
            assert next(rows, None) is None, f"step {plan.step_id}: more cached rows than requests"
            for r, slot in expected:
                if r.status is RUNNING:
                    assert r.slot == slot, f"{r.request_id} holds slot {r.slot}, step {plan.step_id} names it {slot}"
