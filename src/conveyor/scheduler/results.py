"""Applying a worker's result to the plan it answers: sampled tokens, stops, outputs.

:meth:`Scheduler.update` hands the oldest plan in flight and its result here. A result
names rows by slot; the plan's :class:`~conveyor.scheduler.step.Step` says which rows sample
(``sample_slots``) and with which slot generation, so a token for a request that ended
while the plan ran (its slot given back, maybe to someone else) is recognised and dropped.

The worker answers the sampling rows in plan order, so a result is normally read as it
comes (one comparison checks the order); any other result (rows in another order, rows
missing or naming no slot) is first laid out by slot. Either way every sampled token then
goes through one vector pass over the slot columns
(:mod:`~conveyor.scheduler.slot_columns`): the tokens are appended to their requests'
lists in one C-level pass and the stop tests run in bulk; only the rows that need a
decision (a stop, a first token, a request with stop ids of its own, a token the worker
did not send) go through Python, and the rest become the output's columns. That is the
hottest code of a busy server, where almost every row is a plain decode.

A result with ``error`` set, or malformed, fails every still-live request of its plan and of
the plan formed ahead of it (:func:`fail_plans`).

Structured output: the worker names the constrained rows its grammar ended
(``StepResult.end_slots``). A dead end finishes its request as ``error`` before the tokens
are applied, so its token (not a valid one) is dropped like any token of a released slot; a
complete grammar makes its row take the decision path and finish as ``stop`` after its token,
like an end-of-sequence token does (:func:`_grammar_ends`).

Pooling requests sample nothing: the plan's ``poolers`` finish as ``stop`` with the vectors
the result carries (:func:`_finish_pooled`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from conveyor.ipc.messages import (
    FinishReason,
    RequestOutput,
    StepLogprobs,
    StepPlan,
    StepResult,
    TokenLogprobs,
    TokenOutputs,
)
from conveyor.scheduler.preemption import drop_kv
from conveyor.scheduler.request import RequestStatus, SchedulerRequest
from conveyor.scheduler.slot_columns import ALARM, EOS, GEN, KNOWN
from conveyor.scheduler.speculation import back_off
from conveyor.scheduler.step import Step

if TYPE_CHECKING:
    from conveyor.scheduler.state import SchedulerState

RUNNING = RequestStatus.RUNNING
_MISSING = -1  # no token sampled for the slot
# What a sampled token made of its request's output.
_PLAIN, _FIRST, _FINISHED = 0, 1, 2


def stop_reason(req: SchedulerRequest, token: int) -> str | None:
    """Why ``req`` stops after ``token`` was appended to it, in order of precedence; None if it goes on."""
    if token in req.stop_ids:
        return FinishReason.STOP
    if len(req.token_ids) >= req.stop_len:
        return FinishReason.LENGTH
    return None


def apply_result(state: SchedulerState, plan: StepPlan, step: Step, result: StepResult) -> TokenOutputs:
    """The outputs of ``plan`` (just taken off the in-flight line) given its ``result``; see
    :meth:`Scheduler.update`."""
    error = result.error
    slots, tokens = _int_array(result.slots), _int_array(result.sampled_token_ids)
    if error is None and (slots.ndim != 1 or slots.shape != tokens.shape):
        error = f"malformed step result: {slots.size} slots but {tokens.size} tokens"
    if step.failed:
        return TokenOutputs([])  # failed with the plan it was planned ahead of
    if error is not None:
        return TokenOutputs(fail_plans(state, plan, step, error))
    # The KV the plan's prefill chunks wrote can be shared now (the decodes' blocks are
    # registered when their requests release them: see KVCacheManager.free).
    kv = state.kv
    for req, _ in step.scheduled:
        if req.status is RUNNING:  # not ended while the step ran (its blocks are free then)
            kv.register_full_blocks(req, state.done_tokens(req))
    outputs: list[RequestOutput] = []
    column_ids: list[str] = []
    column_tokens: list[int] = []
    runs = _accepted_runs(state, step, result) if step.spec else None
    if len(step.sample_slots):
        finished: list[SchedulerRequest] = []  # running requests this result retires
        complete = _grammar_ends(state, step, result, outputs, finished)
        column_ids, column_tokens = _apply_tokens(state, plan, step, slots, tokens, outputs, finished, complete, runs)
        if finished:
            state.table.prune_running(finished)
    if step.poolers:
        _finish_pooled(state, plan, step, result, outputs)
    if result.logprobs is not None or result.prompt_logprobs is not None:
        column_ids, column_tokens = _attach_logprobs(step, result, outputs, column_ids, column_tokens)
    return TokenOutputs(outputs, column_ids, column_tokens)


def _finish_pooled(
    state: SchedulerState, plan: StepPlan, step: Step, result: StepResult, outputs: list[RequestOutput]
) -> None:
    """The pooling requests whose last prompt chunk the plan ran finish with their vectors
    (``stop``; ``error`` for one the worker pooled none for), their blocks freed now."""
    vectors = dict(zip(result.pooled_slots, result.pooled))
    finished = []
    now = state.clock()
    for req in step.poolers:
        if req.status is not RUNNING:  # ended while the step ran
            continue
        vector = vectors.get(req.slot)
        if vector is None:
            error = f"worker pooled no vector for this request (slot {req.slot}, step {plan.step_id})"
            outputs.append(state.finish(req, FinishReason.ERROR, error=error))
        else:
            req.first_token_time = now  # (its one output)
            out = state.finish(req, FinishReason.STOP)
            out.embedding = vector
            outputs.append(out)
        finished.append(req)
    state.table.prune_running(finished)


def _accepted_runs(state: SchedulerState, step: Step, result: StepResult) -> dict[int, list[int]]:
    """The speculative decodes of ``step`` still held by their requests: move each one's
    computed count back to what it accepted (its rejected proposal's KV is dropped thus, and
    overwritten later), count the proposals, and return slot -> the tokens it gained after its
    first (possibly none). A row the result does not answer keeps none of its proposal."""
    cols = state.cols
    gained = {slot: list(run) for slot, run in zip(result.spec_slots, result.spec_token_ids)}
    planned = dict(zip(step.dslots.tolist(), step.dgens.tolist()))
    runs: dict[int, list[int]] = {}
    per_position = state.spec_accepted_per_position
    verified = 0
    for slot, proposed in step.spec.items():
        if planned[slot] != cols.generation(slot):
            continue  # ended while the plan ran
        run = gained.get(slot, [])[:proposed]
        cols.computed[slot] -= proposed - len(run)
        back_off(cols.owner[slot], len(run))
        verified += 1
        state.spec_proposed_tokens += proposed
        state.spec_accepted_tokens += len(run)
        for position in range(len(run)):
            per_position[position] += 1
        if run:
            runs[slot] = run
    state.spec_num_proposals += verified
    state.spec_num_steps += verified > 0
    return runs


def _grammar_ends(
    state: SchedulerState,
    step: Step,
    result: StepResult,
    outputs: list[RequestOutput],
    finished: list[SchedulerRequest],
) -> np.ndarray | None:
    """Finish the requests the worker's grammar left at a dead end (``error``); returns the slots
    whose grammar is complete (their token decides ``stop`` in :func:`_output`), None if none."""
    if not result.end_slots:
        return None
    cols = state.cols
    complete = []
    planned = dict(zip(step.sample_slots.tolist(), step.sample_gens.tolist()))
    for slot, error in zip(result.end_slots, result.end_errors):
        if planned.get(slot) != cols.generation(slot):
            continue  # ended while the plan ran: its slot was given back (maybe to another request)
        if not error:
            complete.append(slot)
            continue
        req = cols.owner[slot]
        finished.append(req)
        outputs.append(state.finish(req, FinishReason.ERROR, error=f"structured output: {error}"))
    return np.asarray(complete, np.int64) if complete else None


def _split_logprobs(step: Step, lp: StepLogprobs) -> list[tuple[SchedulerRequest, TokenLogprobs]]:
    """A step's log-probability columns cut per request (the one the plan ran on each slot)."""
    chosen = np.frombuffer(lp.token_logprobs, "<f4")
    top_ids = np.asarray(lp.top_ids, np.int32)
    top = np.frombuffer(lp.top_logprobs, "<f4")
    width = lp.width
    out = []
    first = 0
    for slot, start, count in zip(
        _int_array(lp.slots).tolist(), _int_array(lp.starts).tolist(), _int_array(lp.counts).tolist()
    ):
        req = step.owner(slot)
        end = first + count
        if req is not None:
            out.append(
                (
                    req,
                    TokenLogprobs(
                        start,
                        count,
                        width,
                        chosen[first:end].tobytes(),
                        top_ids[first * width : end * width].copy(),
                        top[first * width : end * width].tobytes(),
                    ),
                )
            )
        first = end
    return out


def _drop_head(lp: TokenLogprobs, rows: int) -> TokenLogprobs:
    """``lp`` without its first ``rows`` rows."""
    w = lp.width
    return TokenLogprobs(
        lp.start + rows,
        lp.count - rows,
        w,
        lp.token_logprobs[4 * rows :],
        np.asarray(lp.top_ids)[rows * w :],
        lp.top_logprobs[4 * rows * w :],
    )


def _attach_logprobs(
    step: Step, result: StepResult, outputs: list[RequestOutput], column_ids: list[str], column_tokens: list[int]
) -> tuple[list[str], list[int]]:
    """Give the requests that asked their log-probabilities, on their outputs of this
    iteration: a request whose token went in the columns gets a full output instead (the
    columns stay the plain case), and prompt log-probabilities of a chunk that sampled nothing
    travel in an output without tokens. A sampled token's values go only where the token went
    (none if it was dropped); prompt ones only to a request still running or finished by this
    result, and only from the prompt index it is still owed (a recomputed prefill repeats
    some). Returns the columns left."""
    by_id = {out.request_id: out for out in outputs}
    sampled = _split_logprobs(step, result.logprobs) if result.logprobs is not None else []
    prompt = _split_logprobs(step, result.prompt_logprobs) if result.prompt_logprobs is not None else []
    wanted = {req.request_id for req, _ in sampled}
    if wanted & set(column_ids):
        kept_ids, kept_tokens = [], []
        for request_id, token in zip(column_ids, column_tokens):
            if request_id in wanted:
                out = by_id[request_id] = RequestOutput(request_id, [token])
                outputs.append(out)
            else:
                kept_ids.append(request_id)
                kept_tokens.append(token)
        column_ids, column_tokens = kept_ids, kept_tokens
    for req, lp in sampled:
        out = by_id.get(req.request_id)
        if out is not None and out.new_token_ids:
            out.logprobs = lp
    for req, lp in prompt:
        owed = req.prompt_logprobs_from - lp.start
        if owed >= lp.count:
            continue
        if owed > 0:
            lp = _drop_head(lp, owed)
        out = by_id.get(req.request_id)
        if out is None:
            if req.status is not RUNNING:
                continue
            out = by_id[req.request_id] = RequestOutput(req.request_id, [])
            outputs.append(out)
        out.prompt_logprobs = lp
        req.prompt_logprobs_from = lp.start + lp.count
    return column_ids, column_tokens


def _int_array(values: np.ndarray | list[int]) -> np.ndarray:
    """An Int32Array field as an integer array: as received (scheduler/main.py copies it out
    of the receive buffer), or from the list of a result built in-process."""
    return values if isinstance(values, np.ndarray) else np.asarray(values, np.int64)


def _by_slot(state: SchedulerState, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The result's tokens indexed by slot (:data:`_MISSING` where none came), in the slot
    columns' scratch row; rows naming no slot are ignored."""
    by_slot = state.cols.sampled
    by_slot.fill(_MISSING)
    named = slots >= 0
    if np.count_nonzero(named) < len(named):  # (a negative index would wrap around to a slot)
        slots, tokens = slots[named], tokens[named]
    try:
        by_slot[slots] = tokens
    except IndexError:  # a slot past the last
        named = slots < len(by_slot)
        by_slot[slots[named]] = tokens[named]
    return by_slot


def _apply_tokens(
    state: SchedulerState,
    plan: StepPlan,
    step: Step,
    answered: np.ndarray,
    sampled: np.ndarray,
    outputs: list[RequestOutput],
    finished: list[SchedulerRequest],
    complete: np.ndarray | None = None,
    runs: dict[int, list[int]] | None = None,
) -> tuple[list[str], list[int]]:
    """Append each sampling row's token (the result's rows ``answered`` slots, ``sampled``
    tokens) to its request, in row order; returns the output columns (request ids, tokens)
    of the rows that need no decision (module docstring). ``runs``: speculative rows that
    gained more tokens after that one (slot -> tokens), which take the decision path."""
    cols = state.cols
    slots = step.sample_slots
    expected = step.answer_slots
    if len(answered) == len(expected) and not np.count_nonzero(answered != expected):
        # Answered in plan order, as the worker does.
        tokens, missing = (sampled if step.answer_rows is None else sampled[step.answer_rows]), 0
    else:
        tokens = _by_slot(state, answered, sampled)[slots]
        missing = np.count_nonzero(tokens == _MISSING)
    rows = cols.state.take(slots, axis=1)
    held = rows[GEN] == step.sample_gens  # still held by the request planned on it
    if missing or np.count_nonzero(held) < len(held):
        live = held & (tokens != _MISSING)
        for slot in slots[held & ~live].tolist():
            req = cols.owner[slot]
            finished.append(req)
            outputs.append(
                state.finish(
                    req,
                    FinishReason.ERROR,
                    error=f"worker sampled no token for this request (slot {slot}, step {plan.step_id})",
                )
            )
        slots, tokens, rows = slots[live], tokens[live], rows[:, live]
    slot_list, token_list = slots.tolist(), tokens.tolist()
    cols.append_sampled(slots, slot_list, token_list)
    unusual = rows[KNOWN] >= rows[ALARM] - 1  # (rows were read before the append)
    eos_rows = rows[EOS]
    if np.count_nonzero(eos_rows):
        unusual |= (eos_rows != 0) & cols.is_eos(tokens)
    if complete is not None:
        unusual |= np.isin(slots, complete)
    if runs:
        unusual |= np.isin(slots, np.fromiter(runs, np.int64, len(runs)))
    if not np.count_nonzero(unusual):
        return cols.ids[slots].tolist(), token_list
    plain = ~unusual
    owner = cols.owner
    now = state.clock()
    for row in unusual.nonzero()[0].tolist():
        req = owner[slot_list[row]]
        done = complete is not None and slot_list[row] in complete
        run = runs.get(slot_list[row]) if runs else None
        if run is not None:
            kind = _output_run(state, req, [token_list[row], *run], outputs, now)
        else:
            kind = _output(state, req, token_list[row], outputs, now, done)
        if kind == _FINISHED:
            finished.append(req)
        elif kind == _PLAIN:  # stop ids of its own, none of them sampled
            plain[row] = True
    return cols.ids[slots[plain]].tolist(), tokens[plain].tolist()


def _output(
    state: SchedulerState,
    req: SchedulerRequest,
    token: int,
    outputs: list[RequestOutput],
    now: float,
    complete: bool = False,
) -> int:
    """After ``token`` was appended to ``req``: finish it (``_FINISHED``), or give its first
    token a full output (``_FIRST``); a plain later token (``_PLAIN``) is left to the columns.
    ``complete``: the request's grammar is complete, so it stops here whatever the token."""
    reason = FinishReason.STOP if complete else stop_reason(req, token)
    if req.first_token_time is None:
        req.first_token_time = now
        if reason is None:
            state.cols.first_token_done(req)
            outputs.append(
                RequestOutput(req.request_id, [token], None, None, req.scheduled_time, now, req.num_cached_tokens)
            )
            return _FIRST
    if reason is None:
        return _PLAIN
    outputs.append(state.finish(req, reason, new_token_ids=[token]))
    return _FINISHED


def _output_run(
    state: SchedulerState, req: SchedulerRequest, tokens: list[int], outputs: list[RequestOutput], now: float
) -> int:
    """A speculative decode gained ``tokens`` (the first already appended to ``req``): append
    the others one at a time while it does not stop, a stop (id, length) ending the run
    there, and give what it kept one full output (``_FINISHED`` or ``_FIRST``: never the
    columns, which carry one token). Tokens past a stop are dropped with their KV."""
    cols = state.cols
    kept = 1
    reason = stop_reason(req, tokens[0])
    while reason is None and kept < len(tokens):
        cols.append_run(req.slot, tokens[kept : kept + 1])
        kept += 1
        reason = stop_reason(req, tokens[kept - 1])
    cols.computed[req.slot] -= len(tokens) - kept
    first = req.first_token_time is None
    if first:
        req.first_token_time = now
    if reason is not None:
        outputs.append(state.finish(req, reason, new_token_ids=tokens[:kept]))
        return _FINISHED
    if first:
        cols.first_token_done(req)
        outputs.append(
            RequestOutput(req.request_id, tokens[:kept], None, None, req.scheduled_time, now, req.num_cached_tokens)
        )
    else:
        outputs.append(RequestOutput(req.request_id, tokens[:kept]))
    return _FIRST


def fail_plans(state: SchedulerState, plan: StepPlan, step: Step, error: str) -> list[RequestOutput]:
    """``plan`` failed: so does the plan formed ahead of it, which the worker finds does not
    match its state and fails too (changing nothing but dropping finished slots). Their
    requests fail now, and their copies are as untrustworthy as their KV."""
    failed = step.decodes + [r for r, _ in step.scheduled]
    for entry in state.inflight:
        later = entry.step
        later.failed = True
        failed += later.decodes + [r for r, _ in later.scheduled]
    outputs = []
    for req in failed:
        if req.status is RUNNING:  # not aborted while the step ran (nor failed just above)
            # Nothing this plan was to compute can be trusted, nor what later ones build on it.
            done = state.done_tokens(req) - step.tokens_of(req, state.cols)
            outputs.append(state.finish(req, FinishReason.ERROR, error=error, done=done))
    state.table.prune_running()
    # The worker may have failed before the plans' copies ran: nothing they were to fill can
    # be trusted (also where the finishes above cached those blocks). Victims swapped out by
    # this plan fall back to recompute.
    for failed_plan in [plan] + [entry.plan for entry in state.inflight]:
        state.kv.invalidate_transfers(failed_plan.swap_out, failed_plan.swap_in, failed_plan.copy_blocks)
    for req in step.swapped_out:
        if req.status is RequestStatus.SWAPPED:
            drop_kv(state, req)
    return outputs
