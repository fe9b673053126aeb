"""The runner's grammar constraints: which slots are constrained, and each step's mask.

:class:`GrammarSteps`, a part of the runner, gives constrained requests their matchers
(:mod:`conveyor.worker.grammar_rows`) and fills the grammar bitmask of a step's constrained
sampling rows. A per-slot flag tells a step without constrained rows apart in one numpy test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from conveyor.worker.grammar_rows import GrammarRows
from conveyor.worker.parallel import TensorParallel
from conveyor.worker.request_state import SlotStates
from conveyor.worker.sampler import SamplingBatch
from conveyor.worker.step_state import StepRows


class GrammarSteps:
    """The grammars of the requests on ``requests``' slots (the tokenizer of ``model_dir``);
    only rank 0 of ``tensor_parallel`` samples, so only it holds matchers."""

    def __init__(
        self, model_dir: str | Path, requests: SlotStates, tensor_parallel: TensorParallel, device: torch.device
    ) -> None:
        self.rows = GrammarRows(model_dir)
        self.requests = requests
        self.samples_here = tensor_parallel.rank == 0
        self.device = device
        self.constrained = np.zeros(0, np.bool_)

    def take_in(self, slot: int, grammar: str, num_prompt_tokens: int) -> None:
        """Mark ``slot`` constrained or not, and give a constrained request a fresh matcher
        (a resumed one replays its outputs into it at its first fill)."""
        if slot >= len(self.constrained):
            grown = np.zeros(max(slot + 1, 2 * len(self.constrained), 16), np.bool_)
            grown[: len(self.constrained)] = self.constrained
            self.constrained = grown
        constrained = bool(grammar) and self.samples_here
        self.constrained[slot] = constrained
        if constrained:
            self.requests.states[slot].grammar = self.rows.row(grammar, num_prompt_tokens)

    def constrain(self, batch: SamplingBatch, rows: StepRows, packed: bool, num_rows: int) -> list[tuple[int, str]]:
        """Fill the grammar bitmask of the step's constrained sampling rows into ``batch``
        (conveyor.worker.grammar_rows), after the step's forward was enqueued; returns the
        constrained rows the grammar ended, ``(slot, error)``. Their logits rows are
        ``0..len(rows.sample_rows)-1`` when ``packed`` (the ragged step), else the sampling
        rows' indices (the decode step's bucket of ``num_rows``). A step with no constrained
        row returns after one numpy test."""
        sample_rows = rows.sample_rows
        sample_slots = rows.slots[sample_rows]
        if not len(sample_slots) or not self.constrained[sample_slots].any():
            return []
        in_flight: dict[int, int] | None = None
        items = []
        for j, (i, slot) in enumerate(zip(sample_rows.tolist(), sample_slots.tolist())):
            state = rows.states[i]
            if state.grammar is None:
                continue
            pending = None
            if state.pending:  # the step in flight sampled its last token: wait for it (overlaps this forward)
                if in_flight is None:
                    step = rows.in_flight
                    if step.done is not None:
                        step.done.synchronize()
                    in_flight = dict(zip(step.slots, step.sampled.tolist()))
                pending = in_flight[slot]
            items.append((j if packed else i, slot, state.grammar, state.token_ids, pending))
        mask, ends = self.rows.fill(items, num_rows, self.device)
        batch.bitmask, batch.bitmask_rows = mask.bitmask, mask.rows
        return ends
