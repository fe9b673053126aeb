"""Admission: who may enter the waiting line, and who leaves it for the running batch.

At arrival (:func:`rejection_reason`) a request is refused with an error output when it
could never be served here: its id is live already, it could never fit the KV pool, or a
field the frontend validates is out of range (:func:`~conveyor.protocol.validation.context_problem`,
the one statement of those rules). The frontend refuses such requests before they get here;
the scheduler applies the same function at its entry because it also takes
:class:`AddRequest` messages from in-process callers (the engine, tests, benchmarks) and must
never let one break its invariants. The worker does not repeat these rules.

Each iteration, phase 2 (:func:`~conveyor.scheduler.planning.plan_prompts`) offers the head
of the waiting queue to :func:`try_admit` while the admission gate
(:func:`admission_open`) is open: it starts when a slot (``max_num_seqs``) and blocks for
all its known tokens are free, after its prefix-cache hit; a swapped-out request comes back
with its blocks swapped in by the same plan. Under the priority policy it may preempt
worse-ranked running requests to get them, but only if preempting all of them would make
it fit: nobody is preempted for nothing. Under static batching the same path forms each
batch (:mod:`~conveyor.scheduler.policy`): only into an empty batch or one still forming,
only its members, and each leaving free what the members before it still lack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.ipc.messages import NewRequestData, sequence_id
from conveyor.protocol.validation import context_problem
from conveyor.scheduler.groups import fork_source
from conveyor.scheduler.kv_manager import PrefixMatch
from conveyor.scheduler.policy import blocks_for
from conveyor.scheduler.preemption import make_room
from conveyor.scheduler.request import RequestStatus, SchedulerRequest
from conveyor.scheduler.step import Step

if TYPE_CHECKING:
    from conveyor.scheduler.state import SchedulerState

# Outcomes of an admission attempt that scheduled nothing (>= 0: it was admitted).
NO_SLOT = -1
NO_BLOCKS = -2
HOLD = -3  # preempted in this very iteration, or it would preempt ahead: it waits for the next plan
NOT_MEMBER = -4  # static batching: it arrived after the batch formed, or the batch is complete
NO_LORA_SLOT = -5  # its LoRA adapter is not running and max_loras distinct adapters are

SWAPPED = RequestStatus.SWAPPED


def rejection_reason(state: SchedulerState, req: SchedulerRequest) -> str | None:
    """Why a request just arrived (not queued yet) can never be served (the error text), or None."""
    cfg = state.config
    prompt = req.token_ids
    max_tokens = req.sampling.max_tokens
    rid = req.request_id
    if rid in state.table.live or rid in state.groups:
        return f"request id {rid!r} is already in use by a live request"
    if req.sampling.n > 1 and any(sequence_id(rid, i) in state.table.live for i in range(req.sampling.n)):
        return f"request id {rid!r}: the id of one of its sequences is in use by a live request"
    problem = context_problem(
        prompt,
        max_tokens,
        req.sampling.stop_token_ids,
        state.vocab_size,
        cfg.max_model_len,
        bias_token_ids=list(req.sampling.logit_bias),
        min_tokens=req.sampling.min_tokens,
    )
    if problem is not None:
        return problem
    total = len(prompt) + max_tokens
    # Conservative by one token (the last sampled token never needs a KV slot), so
    # that "fits" reads simply as "its whole length fits in the pool".
    needed = blocks_for(total, cfg.block_size)
    if needed > state.kv.gpu.total:
        return (
            f"prompt + max_tokens = {total} tokens need {needed} KV blocks of "
            f"{cfg.block_size}, but the pool has only {state.kv.gpu.total}"
        )
    return None


def lora_slots_full(state: SchedulerState, lora: str) -> bool:
    """Whether admitting a request of adapter ``lora`` would make the running batch use more
    distinct adapters than the worker's ``max_loras`` device slots. Every plan's rows are
    running requests, so this bound on the running batch bounds every step. Visits the
    running batch, only for requests that name an adapter."""
    running = {r.lora for r in state.table.running if r.lora is not None}
    return lora not in running and len(running) >= state.config.max_loras


def admission_open(state: SchedulerState, num_running_at_start: int, now: float) -> bool:
    """Whether this iteration may admit at all (static batching: only into an empty batch,
    or the rest of a batch still forming; batch formation: enough waiting, or the oldest has
    waited long enough, except for the rest of a static batch, let in when it formed)."""
    policy, queue = state.policy, state.queue
    n = len(queue)
    if not n or not policy.may_admit_into(num_running_at_start, queue.peek()):
        return False
    if policy.forming:
        return True
    return policy.admission_open(n, queue.oldest_enqueue_time(policy.min_batch_size), now)


def try_admit(state: SchedulerState, step: Step, req: SchedulerRequest, now: float, reserved: int) -> int:
    """Admit the queue head ``req`` if it can start: the blocks it reserves for later growth
    (>= 0, :meth:`~conveyor.scheduler.policy.SchedulingPolicy.blocks_lacking`; ``reserved``
    is what the running batch, earlier admissions of this plan included, reserves), or why
    not (:data:`NO_SLOT`, :data:`NO_BLOCKS`, :data:`HOLD`, :data:`NOT_MEMBER`)."""
    if id(req) in step.preempted:
        return HOLD
    if not state.policy.may_join(req):
        return NOT_MEMBER
    max_num_seqs = state.config.max_num_seqs
    kv = state.kv
    running = state.table.running
    if req.lora is not None and lora_slots_full(state, req.lora):
        return NO_LORA_SLOT
    reserve = state.policy.growth_reserve(req.num_prompt_tokens, req.sampling.max_tokens, len(req.token_ids))
    match: PrefixMatch | None = None
    source: SchedulerRequest | None = None

    def need() -> tuple[int, int]:
        """(blocks it needs, blocks available to it); the prefix match it would take in
        ``match``, or the leader it would fork from in ``source``."""
        nonlocal match, source
        source = fork_source(state, req)
        if req.status is SWAPPED:
            n, avail = kv.resume_need(req)
        elif source is not None:
            n, avail = kv.fork_need(req)
        else:
            match = kv.match(req)
            n, avail = kv.admission_need(req, match)
        return n + reserve, avail - reserved

    needed, available = need()
    no_slot = len(running) >= max_num_seqs
    if no_slot or needed > available:
        if not state.policy.preempts_for_admission:
            return NO_SLOT if no_slot else NO_BLOCKS
        # Preempt only if all worse-ranked running requests together make it fit.
        freeable, count = 0, 0
        for victim in reversed(running):
            if victim.rank <= req.rank or (count >= no_slot and available + freeable >= needed):
                break
            freeable += kv.exclusive_blocks(victim)
            count += 1
        if count < no_slot or available + freeable < needed:
            return NO_SLOT if no_slot and count == 0 else NO_BLOCKS

        def fits() -> bool:
            nonlocal needed, available
            needed, available = need()  # (each preemption changes it)
            return len(running) < max_num_seqs and needed <= available

        if not make_room(state, step, req, fits, yields=False):
            # Planned ahead it would preempt: only a plan formed in sync may. Else the
            # estimate counted blocks the request itself shares.
            return HOLD if state.ahead else NO_BLOCKS

    state.queue.pop()
    if req.status is SWAPPED:
        kv.resume(req)
    elif source is not None:
        step.copies += kv.fork(req, source)
    else:
        kv.admit(req, match)
        step.hit_tokens += req.num_computed_tokens
    n = min(len(req.token_ids) - req.num_computed_tokens, step.budget)
    kv.grow(req, req.num_computed_tokens + n)
    req.status = RequestStatus.RUNNING
    req.num_bypassed = 0
    state.table.start_running(req)
    if req.scheduled_time is None:
        req.scheduled_time = now
        req.num_cached_tokens = req.num_computed_tokens
        waited = now - req.enqueue_time
        step.num_admitted += 1
        step.wait_sum += waited
        step.wait_max = max(step.wait_max, waited)
    state.take_slot(req)
    state.policy.joined()
    step.new.append(
        NewRequestData(
            req.request_id,
            req.slot,
            req.all_token_ids,
            req.sampling,
            list(req.block_ids),
            req.num_computed_tokens,
            n,
            req.num_prompt_tokens,
            lora=req.lora,
        )
    )
    step.add_scheduled(req, n)
    return state.policy.blocks_lacking(req)
