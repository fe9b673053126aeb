"""Log-probabilities a step computes for the requests that ask, and their wire columns.

:class:`LogprobSteps`, a part of the runner, computes those of the sampled tokens and of the
prompt positions a step computes; :class:`LogprobRows` holds one step's values on the device
until their copy to the host. Which requests ask is read on the host, so a step where none
does runs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.ipc.messages import StepLogprobs
from conveyor.worker.models.interface import CausalLM
from conveyor.worker.request_state import RequestState, SlotStates, Work
from conveyor.worker.sampler import SamplingColumns, logprobs_of


@dataclass(eq=False)
class LogprobRows:
    """Log-probabilities one step computes (:class:`~conveyor.ipc.messages.StepLogprobs`):
    the host's columns (slot, first sequence index, rows of each request) and the values,
    on the device until :meth:`to_host` starts their copy (not waited for: ``finish`` reads
    them after the step's event, like the sampled ids)."""

    slots: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    width: int
    chosen: torch.Tensor  # float32 [R]
    top_ids: torch.Tensor  # int64 [R, width]
    top_lp: torch.Tensor  # float32 [R, width]

    @classmethod
    def compute(
        cls,
        logits: torch.Tensor,
        rows: np.ndarray,
        tokens: torch.Tensor,
        width: int,
        slots: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        invariant: bool = False,
    ) -> LogprobRows:
        """Of ``logits`` rows ``rows`` (host indices), for ``tokens`` (one per row, on the device);
        ``invariant``: batch-invariant mode's log-softmax (:func:`~conveyor.worker.sampler.logprobs_of`)."""
        index = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(logits.device, non_blocking=True)
        chosen, top_ids, top_lp = logprobs_of(logits, index, tokens, width, invariant)
        return cls(slots, starts, counts, width, chosen, top_ids, top_lp)

    def to_host(self, pinned: bool) -> None:
        def copy(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            return host.copy_(tensor, non_blocking=pinned)

        self.chosen, self.top_ids, self.top_lp = copy(self.chosen), copy(self.top_ids), copy(self.top_lp)

    def message(self) -> StepLogprobs:
        """The wire columns (call after the step's copies are done)."""
        return StepLogprobs(
            self.slots.astype(np.int32),
            self.starts.astype(np.int32),
            self.counts.astype(np.int32),
            self.width,
            self.chosen.numpy().astype("<f4").tobytes(),
            self.top_ids.numpy().astype(np.int32).reshape(-1),
            self.top_lp.numpy().astype("<f4").tobytes(),
        )


class LogprobSteps:
    """The log-probabilities of a runner's steps: the model's LM head (rank 0's) over the rows
    the requests on ``requests``' slots ask for by their ``sampling`` columns; ``invariant``:
    batch-invariant mode."""

    def __init__(
        self,
        model: CausalLM,
        requests: SlotStates,
        sampling: SamplingColumns,
        device: torch.device,
        invariant: bool = False,
    ) -> None:
        self.invariant = invariant
        self.model = model
        self.requests = requests
        self.sampling = sampling
        self.device = device

    def scores_prompt(self, work: list[Work], states: list[RequestState]) -> bool:
        """Whether a row of the step computes a prompt position whose next token's
        log-probability its request asked for: such a step runs the ragged path, whose hidden
        states the prompt's scoring reads (the decode step's graphs keep only the last row's
        logits). The slots that may still need it are a set that forgets a slot once its
        request is gone or past its prompt, so once no such request is held a step pays one
        empty-set test."""
        owed = self.sampling.prompt_logprobs_slots
        if not owed:
            return False
        table = self.requests.states
        for slot in list(owed):
            state = table[slot] if slot < len(table) else None
            if state is None or state.sampling.prompt_logprobs is None or state.num_computed >= state.num_prompt - 1:
                owed.discard(slot)  # (a recomputed request is taken in again, and set again)
        return bool(owed) and any(item.slot in owed for item in work)

    def sampled(
        self, logits: torch.Tensor, rows: np.ndarray, sampled: torch.Tensor, slots: np.ndarray, positions: np.ndarray
    ) -> LogprobRows | None:
        """The sampled tokens' log-probabilities for the requests that ask: ``logits[rows[j]]``
        drew ``sampled[j]`` for the request on ``slots[j]`` at sequence index ``positions[j]``.
        Which requests ask is read on the host (the slots' column): None, and nothing run,
        when none does. The step's width is the largest k asked (each request keeps its own)."""
        asked = self.sampling.logprobs[slots]
        wanted = np.flatnonzero(asked >= 0)
        if not len(wanted):
            return None
        width = min(int(asked[wanted].max()), logits.shape[1])
        tokens = sampled.index_select(0, torch.from_numpy(wanted).to(sampled.device, non_blocking=True))
        return LogprobRows.compute(
            logits,
            rows[wanted],
            tokens,
            width,
            slots[wanted],
            positions[wanted],
            np.ones(len(wanted), np.int64),
            self.invariant,
        )

    def prompt(
        self, hidden: torch.Tensor, work: list[Work], states: list[RequestState], offsets: np.ndarray
    ) -> LogprobRows | None:
        """Log-probabilities of the prompt tokens this step's chunks predict, for the requests
        that ask (``prompt_logprobs``): the hidden state at position ``p`` gives token ``p + 1``,
        so a chunk of positions ``c .. e - 1`` covers tokens ``c + 1 .. min(e, P - 1)`` of a
        prompt of ``P`` tokens (the first prompt token has none; a chunk ending the prompt
        covers up to its last token). ``offsets[i]``: where row ``i``'s tokens start in the
        flat batch. Prompt positions this worker did not compute (a prefix-cache hit) are not
        given here: the scheduler bypasses the cache for such requests."""
        flat: list[np.ndarray] = []
        targets: list[int] = []
        slots, starts, counts = [], [], []
        width = 0
        for i, (item, state) in enumerate(zip(work, states)):
            k = state.sampling.prompt_logprobs
            if k is None:
                continue
            first, end = item.num_computed, min(item.num_computed + item.num_scheduled, state.num_prompt - 1)
            if end <= first:
                continue
            flat.append(np.arange(offsets[i], offsets[i] + end - first))
            targets += state.token_ids[first + 1 : end + 1]
            slots.append(item.slot)
            starts.append(first + 1)
            counts.append(end - first)
            width = max(width, k)
        if not slots:
            return None
        rows = np.concatenate(flat)
        index = torch.from_numpy(rows).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        tokens = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        width = min(width, logits.shape[1])
        return LogprobRows.compute(
            logits,
            np.arange(len(rows)),
            tokens,
            width,
            np.asarray(slots, np.int64),
            np.asarray(starts, np.int64),
            np.asarray(counts, np.int64),
            self.invariant,
        )
