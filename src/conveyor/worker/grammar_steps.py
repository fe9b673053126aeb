"""The runner's grammar-constraint plumbing: which slots are constrained, and each step's mask.

:class:`GrammarSteps` is the part of :class:`~conveyor.worker.model_runner.ModelRunner` that
hands constrained requests their matchers (:mod:`conveyor.worker.grammar_rows`) and fills the
grammar bitmask of a step's constrained sampling rows (a base class of it: it reads the
runner's request state, its tensor-parallel rank, its device and the step in flight). A
per-slot flag tells a step without constrained rows apart in one numpy test.
"""

from __future__ import annotations

import numpy as np

from conveyor.worker.request_state import RequestState
from conveyor.worker.sampler import SamplingBatch


class GrammarSteps:
    """The grammar-constraint plumbing of a runner (module docstring)."""

    def _take_in_grammar(self, slot: int, grammar: str, num_prompt_tokens: int) -> None:
        """Mark ``slot`` constrained or not, and give a constrained request a fresh matcher
        (a resumed one replays its outputs into it at its first fill). Only rank 0 samples."""
        if slot >= len(self._constrained):
            grown = np.zeros(max(slot + 1, 2 * len(self._constrained), 16), np.bool_)
            grown[: len(self._constrained)] = self._constrained
            self._constrained = grown
        constrained = bool(grammar) and self.tensor_parallel.rank == 0
        self._constrained[slot] = constrained
        if constrained:
            self._requests.states[slot].grammar = self._grammars.row(grammar, num_prompt_tokens)

    def _constrain(
        self, batch: SamplingBatch, slots: np.ndarray, sample_rows: np.ndarray, states: list[RequestState], packed: bool,
        num_rows: int,
    ) -> None:
        """Fill the grammar bitmask of the step's constrained sampling rows into ``batch``
        (conveyor.worker.grammar_rows), after the step's forward was enqueued. ``slots`` and
        ``states``: the step's rows; ``sample_rows``: those that sample; their logits rows are
        ``0..len(sample_rows)-1`` when ``packed`` (the ragged step), else ``sample_rows`` (the
        decode step's bucket of ``num_rows``). A step with no constrained row returns after
        one numpy test."""
        sample_slots = slots[sample_rows]
        if not len(sample_slots) or not self._constrained[sample_slots].any():
            return
        in_flight: dict[int, int] | None = None
        items = []
        for j, (i, slot) in enumerate(zip(sample_rows.tolist(), sample_slots.tolist())):
            state = states[i]
            if state.grammar is None:
                continue
            pending = None
            if state.pending:  # the step in flight sampled its last token: wait for it (overlaps this forward)
                if in_flight is None:
                    step = self._in_flight
                    if step.done is not None:
                        step.done.synchronize()
                    in_flight = dict(zip(step.slots, step.sampled.tolist()))
                pending = in_flight[slot]
            items.append((j if packed else i, slot, state.grammar, state.token_ids, pending))
        mask, ends = self._grammars.fill(items, num_rows, self.device)
        batch.bitmask, batch.bitmask_rows = mask.bitmask, mask.rows
        self._ends += ends
