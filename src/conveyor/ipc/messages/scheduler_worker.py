"""Plans and results between the scheduler and the worker: :class:`StepPlan` (with
:class:`NewRequestData` and :class:`CachedRequests`) down, :class:`StepResult` (with
:class:`StepLogprobs`) up.

Invariants the receivers rely on:
- A request's prompt and sampling parameters travel to the worker exactly once
  (in :class:`NewRequestData`); later steps name it by its *slot* (a row of
  :class:`CachedRequests`) with only its newly allocated blocks.
- Slots: on the scheduler <-> worker hop a request is named by a small integer, its slot
  (``0 .. max_num_seqs - 1``), given by the scheduler when it sends the request as
  NewRequestData and taken back when it lists the slot in ``StepPlan.finished_slots``. The
  request id travels only in NewRequestData (for the worker's error messages). A slot
  names at most one request at a time; it may be given to a new request in the very plan
  that drops it, since the worker drops before it adds (below).
- Token ids the worker sampled are not sent back to it: it appends them to its
  own copy of the request's tokens, so both sides agree on ``len(token_ids)``.
- A request the scheduler preempts or retires has its slot listed in
  ``StepPlan.finished_slots`` so the worker can drop its state; a resumed
  request arrives again as :class:`NewRequestData` (maybe on another slot) with all its
  tokens, and with ``num_computed_tokens > 0`` when its KV is already in the blocks it
  names (prefix-cache hits, or blocks swapped back in by the same plan).
- The worker executes a plan in this order: drop ``finished_slots``, run every
  ``swap_out`` copy, then every ``swap_in`` copy, then the forward; ``new_requests`` are
  taken in after the drop. See :class:`StepPlan` for why that order makes same-plan block
  and slot reuse safe.
"""

from __future__ import annotations

import numpy as np
from msgspec import field

from conveyor.ipc.messages.frontend_scheduler import SamplingParams
from conveyor.ipc.messages.tagged import Int32Array, Message, Positional, message

# Slots a scheduler may hand out (its max_num_seqs is at most this); a worker refuses any
# other, so a corrupt plan cannot make it grow its slot table without bound.
MAX_SLOTS = 1 << 20


class StepLogprobs(Positional):
    """Log-probabilities a step computed, for several requests (named by slot), as columns:
    request ``slots[i]`` has ``counts[i]`` rows from sequence index ``starts[i]`` on, laid end to
    end in the arrays, which are as in
    :class:`~conveyor.ipc.messages.frontend_scheduler.TokenLogprobs` (one ``width`` for the
    step)."""

    slots: Int32Array
    starts: Int32Array
    counts: Int32Array
    width: int
    token_logprobs: bytes
    top_ids: Int32Array
    top_logprobs: bytes


# ---------------------------------------------------------------- scheduler -> worker


@message
class NewRequestData(Message, tag=20):
    """First appearance of a request at the worker (or after a preemption).

    ``slot`` is the name later plans give it (their cached rows, ``finished_slots``): free on
    the worker once this plan's ``finished_slots`` are dropped. ``request_id`` travels only
    here, for the worker's messages. ``token_ids`` is every token known so far (prompt, then
    outputs for a resumed request); ``block_ids`` its whole block table.
    ``num_prompt_tokens``: how many of ``token_ids`` are the prompt (the rest are outputs,
    which presence/frequency penalties and ``min_tokens`` count); None: all of them.
    """

    request_id: str
    slot: int
    token_ids: Int32Array
    sampling: SamplingParams
    block_ids: Int32Array
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_prompt_tokens: int | None = None
    # The LoRA adapter the request runs under (its registered name; None: the base model).
    lora: str | None = None


def int_list(values: Int32Array | list[int]) -> list[int]:
    """A fresh list of the Python ints of an Int32Array field: a numpy view over a received
    message when decoded (which must not be kept: its buffer is reused), any sequence of ints
    when the message was built in-process."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


class CachedRequests(Positional):
    """Every request of a plan that the worker already holds, as parallel columns.

    Columns, not one object per request: a decode-heavy step names hundreds of running
    requests, and building, encoding and decoding one small object for each was most of
    the scheduler's per-iteration cost. Row ``i`` is the request on slot ``slots[i]``; the
    rows that get new blocks are listed in ``new_block_rows`` (increasing) with their blocks
    at the same index of ``new_block_ids``, since most steps give most requests none.
    """

    slots: Int32Array = field(default_factory=list)
    num_computed_tokens: Int32Array = field(default_factory=list)
    num_scheduled_tokens: Int32Array = field(default_factory=list)
    new_block_rows: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Speculative decoding: the rows (increasing) that verify proposed tokens, each with its
    # proposal at the same index of ``spec_token_ids``. Such a row runs its last known token
    # then the proposal (``num_scheduled_tokens == 1 + len(proposal)``); the worker verifies
    # it by rejection sampling (conveyor.worker.speculative_verify) and reports the tokens
    # gained in ``StepResult.spec_token_ids``.
    spec_rows: list[int] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # The draft-model method instead: the worker's draft model proposes, and the plan gives
    # each spec row (same index) only how many tokens to draft; ``spec_token_ids`` is empty.
    spec_draft_counts: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.slots)


@message
class StepPlan(Message, tag=22):
    """One iteration's work. The worker samples a token for every scheduled request whose
    tokens are all computed after this step (``num_computed + num_scheduled == len(tokens)``).

    Requests are named by slot (see the module docstring). Order of execution: drop the
    requests on ``finished_slots``, all swap-outs, all swap-ins, the block copies, then the forward;
    ``new_requests`` are taken in after the drop. Dropping first is what lets the scheduler
    give a slot freed since the last plan (a finish, an abort, a preemption in this very
    plan) to a request this plan admits; plans before it, already sent, still name the
    slot's old owner, and the worker runs them first.

    ``swap_out`` lists ``[gpu_block, cpu_block]`` copies into the CPU swap space and
    ``swap_in`` ``[cpu_block, gpu_block]`` copies back; the worker batches each list. The
    scheduler frees a GPU block the moment it decides to swap it out (a preempted request's,
    or a cached block evicted to the CPU tier), and may hand it to another request in the
    same plan (as a fork's copy destination, a swap-in destination or for new KV): the
    copies out run first, so they read the old contents. A CPU block is given one content
    per plan: destinations within each list are distinct, and a CPU block that is both a
    swap-out destination and a swap-in source (a block evicted to the CPU tier and hit again
    by the same plan) is read after it was written.

    ``copy_blocks`` lists ``[src, dst]`` copies inside the GPU cache, run after the swaps: a
    sequence of a parallel-sampling request forking from its first sequence gets its own copy
    of the prompt's last, partly filled block. ``dst`` is freshly allocated to it and never a
    source, so it may be a block this plan swaps out (read before); ``src`` is held by the
    first sequence and may be a block this plan swaps in (the first sequence resumed by it:
    written before). The plan that forks a sequence never preempts either (a plan meets
    requests in rank order and preempts only those ranked below the one needing room), so no
    swap reads ``dst`` expecting the copy nor writes ``src``.

    ``planned_ahead``: the plan was formed while the previous one was in flight, assuming
    it succeeds (its requests' sampled tokens are the inputs of this plan's decodes). If the
    previous step failed, the worker fails this one too without running it: it only drops
    the finished slots.
    """

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: CachedRequests
    finished_slots: Int32Array
    swap_out: list[list[int]] = field(default_factory=list)
    swap_in: list[list[int]] = field(default_factory=list)
    planned_ahead: bool = False
    copy_blocks: list[list[int]] = field(default_factory=list)


# ---------------------------------------------------------------- worker -> scheduler


@message
class StepResult(Message, tag=30):
    """Sampled tokens of one step as parallel columns: the request on ``slots[i]`` sampled
    ``sampled_token_ids[i]``. Rows come in plan order: the new requests that sample, then
    the cached rows that do. ``error`` set means the step failed and none of its requests
    advanced.

    ``end_slots`` / ``end_errors``: constrained rows that the grammar ends (parallel lists).
    An empty error: the grammar is complete, the row's sampled token (end-of-sequence, the
    only one the grammar allowed) is its last and it finishes as ``stop``. A non-empty error:
    a dead end (no token allowed, or the matcher failed); its sampled token is not kept and it
    finishes as ``error`` with that message."""

    step_id: int
    slots: Int32Array
    sampled_token_ids: Int32Array
    error: str | None = None
    forward_time: float = 0.0
    end_slots: list[int] = field(default_factory=list)
    end_errors: list[str] = field(default_factory=list)
    # For the rows whose request asked: the sampled tokens' log-probabilities (one row per
    # slot, at the sampled token's index), and those of the prompt positions the step computed.
    logprobs: StepLogprobs | None = None
    prompt_logprobs: StepLogprobs | None = None
    # Speculative rows (the plan's ``spec_rows``): the request on ``spec_slots[i]`` advanced by
    # its ``sampled_token_ids`` row (the first token it emitted) and then by the tokens
    # ``spec_token_ids[i]`` (the rest; possibly none).
    spec_slots: list[int] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # Pooling requests (``SamplingParams.pooling``) whose last prompt chunk the step ran: the
    # request on ``pooled_slots[i]`` has the L2-normalized vector ``pooled[i]`` (little-endian
    # float32 bytes); such rows sample nothing.
    pooled_slots: list[int] = field(default_factory=list)
    pooled: list[bytes] = field(default_factory=list)
