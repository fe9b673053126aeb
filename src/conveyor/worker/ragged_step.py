"""The ragged step: prefill, chunked prefill, mixed and speculative steps, the new tokens of
every row laid end to end, unpadded (:mod:`conveyor.worker.ragged_inputs`), one forward,
then the sampling of the rows that end their known tokens."""

from __future__ import annotations

import numpy as np
import torch

from conveyor import profiling
from conveyor.worker.draft_model import Drafts
from conveyor.worker.parallel import broadcast_from_first_
from conveyor.worker.ragged_inputs import ragged_inputs
from conveyor.worker.sampler import batch_from_rows
from conveyor.worker.step_parts import StepParts
from conveyor.worker.step_state import StepOutput, StepRows


class RaggedStep:
    """Any step through the flattened batch (:class:`~conveyor.worker.step_parts.StepParts`
    says what it reads)."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    def run(self, rows: StepRows, drafts: Drafts | None = None) -> StepOutput:
        """Forward the step and sample; a drafting row's proposal is the draft's tokens of this
        step (``drafts``)."""
        parts = self.parts
        start = profiling.now_ns()
        work, slots = rows.work, rows.slots
        query_lens = [item.num_scheduled for item in work]
        drafted = drafts.tokens if drafts is not None else None
        tables = parts.requests.tables[slots]
        inputs = ragged_inputs(
            work, rows.states, query_lens, tables, parts.block_size, parts.last_tokens.tokens, drafted
        )
        with parts.adapters.step(rows.states, np.asarray(query_lens, dtype=np.int64)):
            start = parts.timers.prepare.record(start)
            hidden = parts.model(inputs.tokens, inputs.positions, inputs.metadata)
        start = parts.timers.forward.record(start)
        sample_slots = torch.from_numpy(slots[rows.sample_rows]).to(parts.device, non_blocking=True)
        if parts.tensor_parallel.rank == 0:
            out = self._sample(rows, hidden, inputs.ends, query_lens, drafted, sample_slots)
        else:  # rank 0 holds the LM head and samples; the next steps' inputs need its ids here too
            out = StepOutput(torch.empty(len(rows.sample_rows), dtype=torch.int64, device=parts.device), sample_slots)
        broadcast_from_first_(out.sampled, parts.tensor_parallel)
        parts.timers.sample.record(start)
        return out

    def _sample(
        self, rows: StepRows, hidden: torch.Tensor, ends: np.ndarray, query_lens: list[int],
        drafted: torch.Tensor | None,
        sample_slots: torch.Tensor,
    ) -> StepOutput:  # fmt: skip
        """Rank 0's part: the LM head over the rows that sample (and a speculative row's
        proposal positions), the sampler, the verification and the log-probabilities."""
        parts = self.parts
        work, slots, sample_rows = rows.work, rows.slots, rows.sample_rows
        # Speculative rows also score each position before their last (the distributions
        # their proposals are verified against): in the same LM head call, after the sampled rows.
        spec_index = [
            np.arange(end - item.num_scheduled, end - 1) for item, end in zip(work, ends.tolist()) if item.num_proposed
        ]
        logit_rows = np.concatenate([ends[sample_rows] - 1, *spec_index])
        logits = parts.model.compute_logits(hidden[torch.from_numpy(logit_rows).to(parts.device, non_blocking=True)])
        verdict = None
        if spec_index:
            verdict = parts.verifier.verify(logits[len(sample_rows) :], work, slots, drafted)
            logits = logits[: len(sample_rows)]
        # The position of the token being drawn is fixed for each output index of a request,
        # so it keys a seeded draw as well as the output index would, across preemptions too.
        draw_positions = np.fromiter([item.num_computed + item.num_scheduled for item in work], np.int64, len(work))
        rows_slots, rows_positions = slots[sample_rows], draw_positions[sample_rows]
        controls = parts.controls.upload(parts.controls.select(rows_slots, rows_positions))
        batch = batch_from_rows(
            parts.sampling.gather(rows_slots), rows_positions, logits.shape[1], parts.device, controls
        )
        ends_of_grammar = parts.grammar.constrain(batch, rows, True, len(sample_rows))
        sampled = parts.sampler.sample(logits, batch)
        logprobs = parts.logprobs.sampled(logits, np.arange(len(sample_rows)), sampled, rows_slots, rows_positions)
        offsets = ends - np.asarray(query_lens, np.int64)
        prompt_logprobs = parts.logprobs.prompt(hidden, work, rows.states, offsets)
        pooled = parts.pooler.pool(hidden, work, rows.states, offsets)
        return StepOutput(sampled, sample_slots, logprobs, prompt_logprobs, verdict, ends_of_grammar, pooled)
