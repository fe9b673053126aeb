"""Speculative decoding, scheduler side: proposing tokens and widening decodes to verify them.

**Where proposals are made.** The n-gram proposer runs in the scheduler: it holds every
request's token ids (prompt and outputs) as the authority, it decides the step's token budget
and KV blocks, which must count the proposed tokens, and so it knows each decode's width
when it forms the plan. The worker only verifies: it gets each proposal in the plan
(:class:`~conveyor.ipc.messages.CachedRequests` ``spec_rows`` / ``spec_token_ids``).

**Proposer** (:func:`propose_ngram`): prompt lookup. For ``n`` from ``ngram_max`` down to
``ngram_min``, the last ``n`` tokens of the request are searched for earlier in its own tokens
(prompt + output); at the most recent earlier match, the up to ``k`` tokens that followed it
are the proposal. The search is one numpy comparison over a sliding window per ``n``.

**Draft method** (``speculative_method == "draft"``): the proposals come from a smaller model
of the same vocabulary that the worker runs (:mod:`conveyor.worker.draft_model`); only the
worker has its KV and its outputs. The scheduler still decides each speculating decode's
width (up to ``k`` tokens, cut by the rules below, no lookup) and reserves the budget and the
blocks for it; the plan carries the count (``CachedRequests.spec_draft_counts``). The draft's
KV lives in the same block ids as the target's (its own cache tensors), so this accounting
covers both.

**Which decodes speculate** (:func:`conveyor.scheduler.request.speculates`): greedy and sampling requests alike (the
worker's rejection sampling keeps the target's distribution exactly:
:mod:`conveyor.worker.speculative_verify`), unless the request opts out (``speculate``
false) or asks for what verification cannot keep exact yet: log-probabilities, structured
output, penalties, logit bias or ``min_tokens``, ``n > 1``. A proposal is cut so that a
step never yields more tokens than the request may still produce (``stop_len``), to the
step's token budget left after the plain decodes, and to the KV blocks free without
preempting anyone (speculation never preempts; a proposal that does not fit shrinks, maybe
to nothing).

**The batch-size rule.** A step of more than ``speculative_max_batch`` decodes proposes
nothing (counted in ``spec_num_limited_steps``): verifying pays off while a step's cost is
set by reading the weights (memory-bound), where ``1 + k`` tokens a row cost about one; a
large batch's step is compute-bound, every proposed token costs its share and the rejected
ones are waste. The rule looks only at the step's decodes, the part speculation widens.

**The back-off.** A request whose proposal was rejected whole skips proposing for its next
``2**r - 1`` decodes after ``r`` such proposals in a row (at most :data:`MAX_SKIP`); any
accepted token resets it (:func:`back_off`, called with each verified proposal). Text the
request does not repeat makes lookups that hit and miss-predict every step, each verifying
``1 + k`` tokens to keep one; backed off, such a request proposes a few times in
``MAX_SKIP`` steps and costs about a plain decode, while one that copies never backs off.

**Plans in sync while anyone may propose.** A decode's next proposal depends on how many
tokens its last step accepted, so the scheduler plans ahead only while speculation is quiet
(:func:`quiet`: the plan in flight verifies nothing and no running request could propose
next, all backing off or the batch rule holding); a plan formed ahead proposes nothing.
Otherwise every plan is formed with the last result applied.

**Rejected tokens** cost nothing to drop: their KV was written past the computed length,
and :mod:`~conveyor.scheduler.results` moves ``num_computed_tokens`` back to the accepted
length; later steps overwrite those positions. The blocks reserved for them stay with the
request (at most ``num_speculative_tokens`` tokens' worth beyond its known tokens) for its
next proposals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from conveyor.scheduler.slot_columns import KNOWN, STOP_LEN

if TYPE_CHECKING:
    from conveyor.scheduler.state import SchedulerState
    from conveyor.scheduler.step import Step


def propose_ngram(tokens: np.ndarray, k: int, ngram_max: int, ngram_min: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` (``ngram_max`` down to ``ngram_min`` tokens) found; empty if none."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # Windows starting at 0 .. length - n - 1: every earlier occurrence with a token after it.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


MAX_SKIP = 15  # decodes a request skips proposing after 4 or more whole rejections in a row


class BacksOff(Protocol):
    """A request's back-off count (:class:`~conveyor.scheduler.request.SchedulerRequest`'s,
    whose module imports this one for :func:`speculates`)."""

    spec_misses: int
    spec_skip: int


def back_off(req: BacksOff, accepted: int) -> None:
    """A proposal of ``req`` was verified with ``accepted`` tokens kept: the back-off's count
    (module docstring)."""
    req.spec_misses = 0 if accepted else req.spec_misses + 1
    req.spec_skip = min(2**req.spec_misses - 1, MAX_SKIP)


def plan_speculation(state: SchedulerState, step: Step) -> None:
    """Widen the step's decodes (planned by phase 1) whose requests speculate and are not
    backing off with their proposals (n-gram), or with room for ``k`` draft tokens the worker
    makes (draft method), within the budget and the free blocks, best rank first (module
    docstring); none in a step of more than ``speculative_max_batch`` decodes (the batch-size
    rule)."""
    k = state.config.speculative_tokens
    if not k or not len(step.dslots) or step.budget <= 0:
        return
    if 0 < state.config.speculative_max_batch < len(step.dslots):
        state.spec_num_limited_steps += 1  # the batch rule: a large batch's step is compute-bound
        return
    cols, gpu, cfg = state.cols, state.kv.gpu, state.config
    bs = cfg.block_size
    slots = step.dslots.tolist()
    rows = cols.state.take(step.dslots, axis=1)
    room = (rows[STOP_LEN] - rows[KNOWN] - 1).tolist()  # tokens a step may add beyond the first
    drafted = cfg.speculative_method == "draft"  # the worker's draft model proposes: only counts here
    for row, slot in enumerate(slots):
        if step.budget <= 0:
            break
        req = cols.owner[slot]
        limit = min(k, room[row], step.budget)
        if limit < 1 or not req.speculative:
            continue
        if req.spec_skip:  # the back-off
            req.spec_skip -= 1
            continue
        if state.ahead:  # planned ahead: its last token is still pending in the plan in flight
            continue
        proposal = None
        if not drafted:
            proposal = propose_ngram(np.asarray(req.token_ids, np.int64), limit, cfg.ngram_max, cfg.ngram_min)
            limit = len(proposal)
        # The decode runs tokens computed .. computed + n: blocks for all of them.
        first = int(step.dcomputed[row]) + 1  # tokens covered by the plain decode
        n = min(limit, (len(req.block_ids) + gpu.num_available) * bs - first)
        if n < 1:
            continue
        need = max(0, -(-(first + n) // bs) - len(req.block_ids))
        blocks = gpu.allocate(need) if need > 0 else []
        req.block_ids += blocks
        step.add_speculation(row, slot, n, blocks, None if drafted else proposal[:n].tolist())


def quiet(state: SchedulerState, inflight: Step) -> bool:
    """Whether a plan formed now, ahead of the one plan in flight (``inflight``), loses no
    proposal by being formed ahead (:attr:`Scheduler.can_plan_ahead`): the plan in flight
    verifies none, so its results decide no proposal, and no running request could propose
    in the next step: the batch rule holds, or each request that speculates is backing off.
    A plan formed ahead proposes nothing but counts the back-off (:func:`plan_speculation`),
    so speculation resumes in sync once a back-off ends."""
    if inflight.spec:
        return False
    running = state.table.running
    if 0 < state.config.speculative_max_batch < len(running):
        return True
    return not any(req.speculative and not req.spec_skip for req in running)
