"""Pooling: the embedding vectors of prompt-only requests (``SamplingParams.pooling``).

A pooling request runs its prompt like any prefill (chunked when the budget cuts it) and
samples nothing; the step that runs its last prompt chunk pools the final hidden states
(after the model's final norm) and L2-normalizes them: ``last`` takes the last prompt
position's state, ``mean`` the mean over every prompt position. A mean over several chunks
keeps a float32 running sum per slot between steps: the scheduler never reuses a cached
prefix for a pooling request and preempts it by recompute (so its chunks all run here, in
order, on one slot), and a slot dropped or taken in again starts a fresh sum.

The values stay on the device until :meth:`PooledRows.to_host` starts their copy (read in
``finish`` after the step's event, like the sampled ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.worker.request_state import RequestState, Work


@dataclass(eq=False)
class PooledRows:
    """One step's pooled vectors: ``vectors[i]`` (float32) is the request on ``slots[i]``'s."""

    slots: list[int]
    vectors: torch.Tensor

    def to_host(self, pinned: bool) -> None:
        host = torch.empty(self.vectors.shape, dtype=torch.float32, pin_memory=pinned)
        self.vectors = host.copy_(self.vectors, non_blocking=pinned)

    def message(self) -> list[bytes]:
        """Each vector as little-endian float32 bytes (call after the step's copy is done)."""
        values = self.vectors.numpy().astype("<f4")
        return [row.tobytes() for row in values]


class Pooler:
    """The slots of a runner's pooling requests and the running sums of those that mean-pool
    (module docstring). A step without pooling requests pays one empty-set test per question."""

    def __init__(self) -> None:
        self.slots: set[int] = set()
        self._sums: dict[int, torch.Tensor] = {}

    def take_in(self, slot: int, pooling: str) -> None:
        """A new request on ``slot`` (pooling or not): no sum carries over from its last holder."""
        self.forget([slot])
        if pooling:
            self.slots.add(slot)

    def forget(self, slots: list[int]) -> None:
        """The requests on ``slots`` were dropped."""
        if self.slots:
            for slot in slots:
                self.slots.discard(slot)
                self._sums.pop(slot, None)

    def in_step(self, work: list[Work]) -> bool:
        """Whether a row of the step pools (it then runs the ragged path, whose hidden states
        pooling reads)."""
        slots = self.slots
        return bool(slots) and any(item.slot in slots for item in work)

    def sampling_rows(self, work: list[Work], samples: list[bool]) -> list[bool]:
        """``samples`` (the rows that end their known tokens) less the pooling rows, which
        sample nothing."""
        slots = self.slots
        if not slots:
            return samples
        return [flag and item.slot not in slots for item, flag in zip(work, samples)]

    def pool(
        self, hidden: torch.Tensor, work: list[Work], states: list[RequestState], offsets: np.ndarray
    ) -> PooledRows | None:
        """Add this step's chunks of the pooling rows to their sums and pool the rows whose
        chunk ends the prompt. ``hidden``: the step's final hidden states, flat; row ``i``'s
        tokens start at ``offsets[i]``. None when no row finishes its prompt."""
        if not self.slots:
            return None
        slots: list[int] = []
        vectors: list[torch.Tensor] = []
        for i, (item, state) in enumerate(zip(work, states)):
            method = state.sampling.pooling
            if not method:
                continue
            start, n = int(offsets[i]), item.num_scheduled
            last = item.num_computed + n >= state.num_prompt
            if method == "mean":
                chunk = hidden[start : start + n].float().sum(0)
                total = self._sums.pop(item.slot, None)
                total = chunk if total is None else total + chunk
                if not last:
                    self._sums[item.slot] = total
                    continue
                vector = total / state.num_prompt
            elif last:
                vector = hidden[start + n - 1].float()
            else:
                continue
            slots.append(item.slot)
            vectors.append(torch.nn.functional.normalize(vector, dim=0))
        if not slots:
            return None
        return PooledRows(slots, torch.stack(vectors))


def result_fields(pooled: PooledRows | None) -> dict[str, list]:
    """The :class:`~conveyor.ipc.messages.StepResult` fields of a step's pooled rows."""
    if pooled is None:
        return {}
    return {"pooled_slots": pooled.slots, "pooled": pooled.message()}
