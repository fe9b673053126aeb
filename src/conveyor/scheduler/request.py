"""One request's state as the scheduler sees it.

Token-centric: a request is a token list (prompt, then the outputs sampled so far) and
``num_computed_tokens``, how many of those tokens have their KV in the cache. Whatever
lies between is what the next steps must run: the rest of a prompt (prefill, maybe in
chunks), or the single last-sampled token (decode). Resuming a preempted request is
just a longer prefill; a prefix-cache hit or a swap-in starts it with
``num_computed_tokens > 0``.

Invariants the scheduler keeps:
- RUNNING: ``block_ids`` covers at least ``num_computed_tokens`` tokens, and
  ``num_computed_tokens < num_tokens`` between steps (there is always a token to run).
- WAITING / PREEMPTED: holds no blocks and ``num_computed_tokens == 0``.
- SWAPPED: its computed KV lives in ``cpu_blocks`` (``(index in the block table, CPU
  block)``, one per computed block); ``block_ids`` is all -1 (it holds no GPU block);
  ``num_computed_tokens`` is kept.
- FINISHED: holds nothing; nothing reads its counts.
- RUNNING with plans in flight: ``num_computed_tokens`` counts what those plans compute,
  and may reach past the known tokens by the tokens they sample (pending: their values
  are appended when the results come back).
- ``slot`` (``>= 0``: the worker holds its state, under that slot) is given by the plan
  that sends the request as NewRequestData and taken back (``-1``) when the slot is queued
  for ``finished_slots`` (finish, abort, error, preemption). So RUNNING requests hold a
  slot each, all distinct, and nobody else holds one; a slot given back may go to another
  request at once (the worker drops before it takes in, see the scheduler's docstring).
- ``rank`` is fixed when the request is queued the first time: a preempted request keeps
  its place in line. Smaller ranks go first.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from conveyor.ipc.messages import AddRequest, SamplingParams, int_list, sequence_id


def speculates(sp: SamplingParams) -> bool:
    """Whether a request with these parameters may verify proposals (:mod:`conveyor.scheduler.speculation`:
    those whose output verification keeps exact, unless opted out)."""
    return (
        sp.speculate
        and sp.n == 1
        and sp.logprobs is None
        and sp.prompt_logprobs is None
        and not sp.grammar
        and sp.presence_penalty == 0
        and sp.frequency_penalty == 0
        and sp.repetition_penalty == 1.0
        and not sp.logit_bias
        and sp.min_tokens == 0
        and not sp.pooling
    )


class Columns(Protocol):
    """What a request reads of the scheduler's per-slot columns
    (:class:`~conveyor.scheduler.slot_columns.SlotColumns`, which import this module)."""

    flat: memoryview


# Requests without stop tokens of their own share one stop set (the EOS set, or this empty
# one) instead of each building a copy: the decode loop reads it for every token.
_NO_STOP_IDS: frozenset[int] = frozenset()


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # in the batch: prefilling or decoding
    PREEMPTED = "preempted"  # was running, KV dropped, queued again for recompute
    SWAPPED = "swapped"  # was running, KV in the CPU swap space, queued to be swapped back
    FINISHED = "finished"  # retired; blocks freed


@dataclass(eq=False, slots=True)
class SchedulerRequest:
    """Mutable per-request state. Compared by identity: ids can be reused after a request ends."""

    request_id: str
    token_ids: list[int]  # the prompt, then every output token
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # num_computed_tokens while it holds no slot (see the property)
    _computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    cpu_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Content ids (PrefixIndex) of its computed full blocks, in order: the chain a
    # continuation of its blocks is keyed on. len == num_registered_blocks.
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    rank: tuple = ()
    enqueue_time: float = 0.0  # scheduler clock when it arrived
    num_bypassed: int = 0  # admissions that passed it while it could not fit
    queue_entry: list | None = None  # its live entry in the waiting heap
    scheduled_time: float | None = None  # time of first admission
    first_token_time: float | None = None  # time when the first output arrived
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    slot: int = -1  # its name on the worker while it holds the request's state; -1: none
    finish_reason: str | None = None
    # Stop conditions, precomputed: a sampled id in stop_ids stops it; so does reaching stop_len tokens.
    stop_ids: frozenset[int] = frozenset()
    stop_len: int = 0
    has_own_stop_ids: bool = False  # stop ids beyond the EOS set (the decode columns check only EOS)
    # With prompt_logprobs: the prompt index from which they are still owed (index 0 has none).
    # A recomputed prefill gives them again; only the owed ones are sent.
    prompt_logprobs_from: int = 1
    # The scheduler's per-slot columns, which hold num_computed_tokens while it holds a slot.
    columns: Columns | None = None
    # The parallel-sampling request it is a sequence of (scheduler/groups.py), or None.
    group: SeqGroup | None = None
    # The LoRA adapter it runs under (None: the base model), and the root its prefix-cache
    # chain starts from: 0 (prefix_index.ROOT) for the base, a negative id per adapter, so a
    # block computed under one adapter is never found for another or for the base.
    lora: str | None = None
    prefix_root: int = 0
    # Whether its decodes may verify proposed tokens (scheduler/speculation.py), when the
    # server speculates; its proposals rejected whole in a row, and the decodes it still
    # skips proposing for because of them (the back-off of scheduler/speculation.py).
    speculative: bool = False
    spec_misses: int = 0
    spec_skip: int = 0

    @classmethod
    def from_message(cls, msg: AddRequest, eos_token_ids: frozenset[int], max_model_len: int) -> SchedulerRequest:
        sp = msg.sampling
        stop_ids = _NO_STOP_IDS if sp.ignore_eos else eos_token_ids
        if sp.stop_token_ids:
            stop_ids = stop_ids | frozenset(sp.stop_token_ids)
        return cls(
            request_id=msg.request_id,
            token_ids=int_list(msg.prompt_token_ids),  # a copy: a received prompt views the message
            num_prompt_tokens=len(msg.prompt_token_ids),
            sampling=sp,
            arrival_time=msg.arrival_time,
            priority=msg.priority,
            stop_ids=stop_ids,
            has_own_stop_ids=bool(sp.stop_token_ids),
            # (a pooling request runs its prompt and no more, as one of max_tokens 1 whose token
            # is never sampled: planned ahead, its last prompt token runs, and nothing after it)
            stop_len=min(len(msg.prompt_token_ids) + (1 if sp.pooling else sp.max_tokens), max_model_len),
            lora=msg.lora or None,
            speculative=speculates(sp),
        )

    @property
    def num_computed_tokens(self) -> int:
        """Tokens of ``token_ids`` whose KV is in the cache (or planned to be, see the
        invariants). While the request holds a slot the value lives in the scheduler's
        :class:`~conveyor.scheduler.slot_columns.SlotColumns`, where decodes advance it in bulk."""
        slot = self.slot
        return self._computed if slot < 0 else self.columns.flat[slot]  # (COMPUTED is field 0)

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        slot = self.slot
        if slot < 0:
            self._computed = value
        else:
            self.columns.flat[slot] = value

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A fresh list of prompt + outputs (a copy: plans must not alias live state)."""
        return list(self.token_ids)


_SEED_MOD = 1 << 64


def sequence_seed(seed: int | None, index: int) -> int | None:
    """Sequence ``index``'s seed: ``seed + index`` wrapped into the 64-bit range seeds are
    given in ([-2**63, 2**64)), which the sampler reads modulo 2**64."""
    if seed is None:
        return None
    derived = seed + index
    return derived - _SEED_MOD if derived >= _SEED_MOD else derived


@dataclass(eq=False, slots=True)
class SeqGroup:
    """The sequences of one request; ``held`` are those not queued yet (module docstring)."""

    request_id: str
    seqs: list[SchedulerRequest]
    held: list[SchedulerRequest] = field(default_factory=list)
    num_live: int = 0

    @property
    def leader(self) -> SchedulerRequest:
        return self.seqs[0]

    @classmethod
    def fan_out(cls, req: SchedulerRequest, n: int) -> SeqGroup:
        """The group of ``n`` sequences of ``req`` (a request built from the message, never queued)."""
        group = cls(req.request_id, [])
        for i in range(n):
            # Prompt log-probabilities are the request's, once: the leader's prefill computes
            # them (a fork never runs the prompt, and asking would cost it the prefix match).
            prompt_logprobs = req.sampling.prompt_logprobs if i == 0 else None
            sampling = msgspec.structs.replace(
                req.sampling, seed=sequence_seed(req.sampling.seed, i), prompt_logprobs=prompt_logprobs
            )
            seq = dataclasses.replace(
                req,
                request_id=sequence_id(req.request_id, i),
                token_ids=list(req.token_ids),
                sampling=sampling,
                block_ids=[],
                cpu_blocks=[],
                block_hashes=[],
            )
            seq.group = group
            group.seqs.append(seq)
        group.held = group.seqs[1:]
        group.num_live = n
        return group
