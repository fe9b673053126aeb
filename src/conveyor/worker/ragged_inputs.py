"""The flattened inputs of a ragged step: every row's new tokens laid end to end, unpadded.

The target model's prefill, chunked-prefill, mixed and speculative steps
(:meth:`~conveyor.worker.ragged_step.RaggedStep.run`) and the draft model's pass over
the same rows (:mod:`conveyor.worker.draft_model`) build their inputs here, so both models see
the same tokens at the same positions in the same blocks: what keeps the draft's KV valid
wherever the target's is.

Where a row's tokens come from: its known tokens on the host; its last input, when only the
device has it (sampled by the step in flight: ``pending``), from the per-slot last tokens on
the device; a speculative row's proposal from the plan (n-gram) or, drafted in this step,
from the draft's tokens on the device. Nothing here waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.worker.attention.backend import AttentionMetadata, token_positions
from conveyor.worker.request_state import RequestState, Work


@dataclass
class RaggedInputs:
    """One ragged forward's inputs (device tensors and the metadata every layer reads)."""

    tokens: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    query_lens: list[int]

    @property
    def ends(self) -> np.ndarray:
        """Each row's end in the flattened batch (its last token is row ``end - 1``)."""
        return np.asarray(self.metadata.query_start_loc_host[1:], dtype=np.int64)


def ragged_inputs(
    work: list[Work],
    states: list[RequestState],
    counts: list[int],
    tables: np.ndarray,
    block_size: int,
    last_tokens: torch.Tensor,
    drafted: torch.Tensor | None = None,
) -> RaggedInputs:
    """Row ``i`` runs ``counts[i]`` tokens from its computed count on (block table
    ``tables[i]``). A speculative row run whole (more than one token) is its last known token
    (on the host: checked) then its proposal: the plan's tokens, or the next ``num_drafted``
    of ``drafted`` (flat, in row order). ``last_tokens``: the per-slot last tokens on the
    device, read for inputs the host has not seen yet."""
    input_ids: list[int] = []
    on_device: list[tuple[int, int]] = []  # (flat index, slot): inputs sampled by the step in flight
    draft_at: list[int] = []  # flat indices of the drafted tokens, in row order
    for item, state, n in zip(work, states, counts):
        end = item.num_computed + n
        known = state.token_ids
        if n > 1 and item.num_proposed:
            input_ids += known[item.num_computed : item.num_computed + 1]
            if item.proposal:
                input_ids += item.proposal
            else:
                draft_at += range(len(input_ids), len(input_ids) + item.num_drafted)
                input_ids += [0] * item.num_drafted
        elif end > len(known):  # its last input is the pending token: only the device has it
            on_device.append((len(input_ids) + n - 1, item.slot))
            input_ids += known[item.num_computed : end]
            input_ids.append(0)
        else:
            input_ids += known[item.num_computed : end]
    device = last_tokens.device
    context_lens = [item.num_computed for item in work]
    metadata = AttentionMetadata.build(counts, context_lens, tables, block_size, device)
    positions = torch.from_numpy(token_positions(counts, context_lens)).to(device, non_blocking=True)
    tokens = torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True)
    if on_device:
        index, pending = torch.tensor(on_device, dtype=torch.int64).to(device, non_blocking=True).unbind(1)
        tokens[index] = last_tokens[pending]
    if draft_at:
        tokens[torch.tensor(draft_at, dtype=torch.int64).to(device, non_blocking=True)] = drafted
    return RaggedInputs(tokens, positions, metadata, list(counts))
