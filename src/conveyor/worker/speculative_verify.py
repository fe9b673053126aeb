"""Greedy verification of a step's speculative rows, when the step finishes.

:class:`SpeculativeVerify` is the part of :class:`~conveyor.worker.model_runner.ModelRunner`
that checks each speculative row's proposal against the target model's argmax (a base class
of it: it reads the runner's per-slot last tokens and tensor-parallel rank). With tensor
parallelism only rank 0 scores the proposals; it broadcasts the targets, and every rank runs
the same acceptance on them. The target's argmax at the proposal's
positions comes from the step's LM head call (``LaunchedStep.spec_targets``): the ragged
step's or the static decode-verify step's, both through :meth:`SpeculativeVerify._verify_targets`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.worker.parallel import broadcast_from_first_

if TYPE_CHECKING:
    from conveyor.worker.model_runner import LaunchedStep


class SpeculativeVerify:
    """The speculative-decoding verification of a runner (module docstring)."""

    def _verify_targets(self, logits: torch.Tensor) -> torch.Tensor:
        """The target model's verdict at the proposal positions, from its logits there (one
        row per proposed token, flat in speculative-row order): the greedy argmax."""
        return logits.argmax(dim=-1)

    def _shared_targets(self, targets: torch.Tensor | None, count: int) -> torch.Tensor:
        """Rank 0's ``count`` targets on every rank of a tensor-parallel group (``targets``:
        this rank's, None where it holds no LM head), so that every rank accepts the same
        tokens and keeps the same request state; the same tensor at size 1."""
        if self.tensor_parallel.size == 1:
            return targets
        if targets is None:
            targets = torch.empty(count, dtype=torch.int64, device=self.device)
        return broadcast_from_first_(targets, self.tensor_parallel)

    def _accept(self, launched: LaunchedStep, tokens: list[int]) -> tuple[list[int], list[list[int]]]:
        """Greedy verification of the step's speculative rows, on the host: a row's targets are
        the argmax after its last known token and after each proposed token (the last one is
        its sampled, greedy, token). It keeps the longest prefix of the proposal equal to the
        targets, then the target at the first mismatch (or after the whole proposal). Its
        ``tokens`` entry becomes the first target; returns the slots and the further tokens
        gained, and moves each row's computed count back past its rejected tokens (their KV is
        simply overwritten later)."""
        targets = launched.spec_targets.tolist()
        slots, runs = [], []
        at = 0
        for row, proposal in zip(launched.spec_rows, launched.spec_proposals):
            k = len(proposal)
            row_targets = targets[at : at + k] + [tokens[row]]
            at += k
            accepted = 0
            while accepted < k and proposal[accepted] == row_targets[accepted]:
                accepted += 1
            tokens[row] = row_targets[0]
            run = row_targets[1 : accepted + 1]
            state = launched.states[row]
            state.num_computed -= k - accepted
            slot = launched.slots[row]
            with torch.inference_mode():  # (its last token, should a plan ahead read it)
                self._last_tokens[slot] = (run or row_targets[:1])[-1]
            slots.append(slot)
            runs.append(run)
        return slots, runs
