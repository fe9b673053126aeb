"""The decode step: every row runs one token, through static buffers and CUDA graphs.

A busy server's steps are mostly decodes. With speculative decoding they are decode-verify
steps: each row runs its last token and a proposal of up to ``k`` tokens (``q = 1 + k``
query tokens per row, the same for every row of a step: shorter proposals are padded, their
positions store no KV and their outputs are never read); the plain decode is ``q == 1``.
Such a step does not build its inputs afresh: it pads the batch to a bucket of rows and
fills persistent device buffers from one pinned staging buffer in one copy
(:mod:`conveyor.worker.step_buffers`), then runs the forward over them: replayed from a CUDA
graph captured at startup (:mod:`conveyor.worker.cuda_graphs`), keyed by ``q`` and the
paged decode kernel's launch plan, or eagerly (CPU, ``enforce_eager``).
The attention is the split-K paged decode kernel's, ``q`` query tokens per row (each causal
over its row's context; the torch backend's on CPU). The LM head scores
each row's last real token (what it samples after) and, for a verify, its proposal
positions, whose logits go to the same verification as the ragged path's
(:meth:`~conveyor.worker.speculative_verify.SpeculativeVerify._verify_proposals`).

:class:`DecodeStep` is the part of :class:`~conveyor.worker.model_runner.ModelRunner` that
does this (a base class of it: it reads the runner's model, request state, sampling columns,
sampling controls and timers, which the runner sets up before :meth:`DecodeStep._setup_decode_step`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from conveyor import profiling
from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.attention.triton_backend import TritonPagedAttention
from conveyor.worker.cuda_graphs import DecodeGraphs
from conveyor.worker.parallel import broadcast_from_first_
from conveyor.worker.request_state import RequestState, Work

if TYPE_CHECKING:
    from conveyor.worker.logprob_steps import LogprobRows
from conveyor.worker.sampler import batch_of_columns, host_flags
from conveyor.worker.step_buffers import DecodeInputs, StepBuffers, context_buckets, decode_buckets, smallest_fitting


class DecodeStep:
    """The decode-only step of a runner (module docstring)."""

    def _static_query_len(self, work: list[Work]) -> int | None:
        """The query tokens per row ``q`` of a step that can run through the static buffers:
        every row a decode, with a proposal of at most the runner's verify width (one token and
        no proposal: ``q == 1``), and every row's ``q`` positions inside the buffers' context.
        ``q - 1`` is the step's verify width ``k``: the longest proposal rounded up to one of
        ``self._verify_widths`` (with graphs, 0 or the configured width). None: the ragged path."""
        longest = 0
        for item in work:
            if item.num_scheduled != 1 + len(item.proposal):
                return None
            longest = max(longest, len(item.proposal))
        if longest > self._verify_widths[-1]:
            return None
        q = 1 + smallest_fitting(self._verify_widths, longest)
        if max(item.num_computed for item in work) + q > self._context_bounds[-1]:
            return None
        return q

    def _run_decode(
        self, work: list[Work], states: list[RequestState], samples: list[bool], q: int
    ) -> tuple[torch.Tensor, torch.Tensor, LogprobRows | None, None]:
        """A decode or decode-verify step (``q`` tokens per row, from :meth:`_static_query_len`)
        through the static buffers: stage every input on the host, one copy to the device, then
        the captured graph of the step's bucket (or the same forward run eagerly), then the
        sampler over the bucket's rows; padded rows, and padded positions of rows whose proposal
        is shorter than ``q - 1``, are ignored (no KV stored, outputs never read).

        A row runs its last known token then its proposal; it samples after its last real token
        and, for a verify, the target logits at its proposal positions (the scored rows
        ``logit_index[rows:]``) go to :meth:`_verify_proposals` as the ragged path's do."""
        start = profiling.now_ns()
        n = len(work)
        rows = self._buffers.bucket_for(n)
        slots = np.fromiter([item.slot for item in work], np.int64, n)
        computed = np.fromiter([item.num_computed for item in work], np.int64, n)
        lengths = np.fromiter([len(item.proposal) for item in work], np.int64, n)  # proposal tokens per row
        max_seq_len = int(computed.max()) + q
        if self._graphs is not None:
            bound = self._graphs.bound_for(rows, q, max_seq_len)
        else:
            bound = smallest_fitting(self._context_bounds, max_seq_len)
        width = -(-bound // self.block_size)
        host = self._buffers.stage(rows, width, q)
        pending = np.fromiter(
            [item.num_computed >= len(state.token_ids) for item, state in zip(work, states)], np.bool_, n
        )
        token_ids = host["input_ids"].reshape(rows, q)
        token_ids[:n, 0] = [
            0 if late else state.token_ids[item.num_computed] for item, state, late in zip(work, states, pending)
        ]
        for row in np.flatnonzero(lengths).tolist():
            token_ids[row, 1 : 1 + lengths[row]] = work[row].proposal
        host["from_device"][:n] = pending
        host["last_slots"][:n] = slots
        # A padded position repeats its row's last real position (a valid rotary position); its
        # KV is not stored (slot -1) and its output is never read.
        offsets = np.arange(q)[None, :]
        real = offsets <= lengths[:, None]
        positions = computed[:, None] + np.minimum(offsets, lengths[:, None])
        host["positions"].reshape(rows, q)[:n] = positions
        tables = self._requests.tables[slots]
        columns = min(width, tables.shape[1])
        host["block_tables"][:n, :columns] = tables[:, :columns]
        blocks = np.take_along_axis(tables, positions // self.block_size, axis=1)
        host["slot_mapping"].reshape(rows, q)[:n] = np.where(real, blocks * self.block_size + positions % self.block_size, -1)
        host["seq_lens"][:n] = computed + q
        host["context_lens"][:n] = computed
        firsts = np.arange(rows) * q
        host["logit_index"][:n] = firsts[:n] + lengths
        host["logit_index"][rows:] = (firsts[:, None] + offsets[:, :-1]).ravel()
        targets = np.concatenate(
            [rows + row * (q - 1) + np.arange(lengths[row]) for row in np.flatnonzero(lengths).tolist()] or [[]]
        )
        t = len(targets)
        host["target_index"][:t] = targets
        draws = computed + lengths + 1  # the position of the token each row draws
        sample_rows = np.flatnonzero(samples)
        m = len(sample_rows)
        host["sample_rows"][:m] = sample_rows
        host["sample_slots"][:m] = slots[sample_rows]
        selection = self._controls.select(slots[sample_rows], draws[sample_rows])
        c = 0
        if selection is not None:
            c = len(selection.rows)
            host["control_rows"][:c] = sample_rows[selection.rows]
            host["control_pool_rows"][:c] = selection.pool_rows
        params = self._sampling.gather(slots)
        for name, column in params.items():
            host[name][:n] = column
        flags = host_flags({name: column[sample_rows] for name, column in params.items()}, self.model_config.vocab_size)
        seq_lens_host = host["seq_lens"].tolist()  # the torch backends' host lengths (before the buffer is reused)
        inputs = self._buffers.upload(rows, width, q)
        if pending.any():
            first_ids = inputs.input_ids.view(rows, q)[:, 0]
            first_ids.copy_(torch.where(inputs.from_device, self._last_tokens[inputs.last_slots], first_ids))
        # Graphs are captured without adapters: a step with adapter rows runs eagerly.
        with_adapters = self._begin_lora(states, np.full(rows, q, dtype=np.int64))
        start = self._t_prepare.record(start)
        try:
            if self._graphs is not None and not with_adapters:
                self._graphs.replay(rows, q, bound)
            else:
                self._forward_decode(inputs, bound, seq_lens_host)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        start = self._t_forward.record(start)

        sample_slots = inputs.sample_slots[:m]
        if self.tensor_parallel.rank == 0:
            controls = None
            if selection is not None:
                controls = self._controls.rows_of(selection, inputs.control_rows[:c], inputs.control_pool_rows[:c])
            draw_positions = _scored(inputs.positions, inputs)[:rows] + 1
            batch = batch_of_columns(inputs.tensors, draw_positions, flags, controls)
            self._constrain(batch, slots, sample_rows, states, False, rows)
            sampled = self.sampler.sample(self._logits[:rows], batch).index_select(0, inputs.sample_rows[:m])
            # After the graph, on the same logits, for the rows that ask (the host knows which).
            logprobs = self._sampled_logprobs(self._logits, sample_rows, sampled, slots[sample_rows], draws[sample_rows])
            if t:
                self._spec_verdict = self._verify_proposals(self._logits.index_select(0, inputs.target_index[:t]), work, slots)
        else:
            sampled = torch.empty(m, dtype=torch.int64, device=self.device)
            logprobs = None
        broadcast_from_first_(sampled, self.tensor_parallel)
        self._t_sample.record(start)
        return sampled, sample_slots, logprobs, None

    def _forward_decode(self, inputs: DecodeInputs, bound: int, seq_lens_host: list[int] | None = None) -> None:
        """Embedding to logits of a decode bucket, reading only ``inputs`` (fixed device views)
        and writing ``self._logits[:rows * q]`` (rank 0) in ``inputs.logit_index`` order: what
        the CUDA graphs capture.

        ``bound`` is an upper bound on every row's context: it fixes the decode kernel's
        partitioning. ``seq_lens_host`` (the staged lengths) serves the torch backends, which
        plan on the host; captured graphs never read it (padding's lengths stand in)."""
        rows, q = inputs.rows, inputs.query_len
        metadata = AttentionMetadata(
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            context_lens=inputs.context_lens,
            block_tables=inputs.block_tables,
            slot_mapping=inputs.slot_mapping,
            max_seq_len=bound,
            max_query_len=q,
            block_size=self.block_size,
            query_start_loc_host=list(range(0, rows * q + 1, q)),
            seq_lens_host=seq_lens_host if seq_lens_host is not None else [q] * rows,
            uniform_query=True,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, metadata)
        if self.tensor_parallel.rank == 0:
            self._logits[: rows * q].copy_(self.model.compute_logits(_scored(hidden, inputs)))

    def _setup_decode_step(
        self,
        max_num_seqs: int,
        enforce_eager: bool,
        pad_decode: bool | None,
        backend: AttentionBackend,
        verify_width: int = 0,
    ) -> None:
        """Static decode buffers for up to ``max_num_seqs`` rows of up to ``1 + verify_width``
        query tokens, and on CUDA (unless ``enforce_eager``, with the Triton backend and no
        tensor parallelism) their graphs.

        Decode batches pad to the graph buckets (:func:`decode_buckets`) when graphs replay
        them; run eagerly, padding would only add rows of work (a third more at worst on a
        CPU, which is compute-bound), so every row count is its own bucket, unless
        ``pad_decode`` says otherwise (tests exercise padding on CPU with it). Likewise a
        verify step pads its proposals to the fixed ``verify_width`` (one graph per bucket and
        width: 0 and ``verify_width``), or eagerly unpadded to its longest proposal."""
        config = self.model_config
        # The longest context a decode row can have: the pool, and the model's positions.
        max_context = min(self.num_blocks, -(-config.max_position_embeddings // self.block_size)) * self.block_size
        use_graphs = (
            self._cuda and not enforce_eager and isinstance(backend, TritonPagedAttention) and self.tensor_parallel.size == 1
        )
        if pad_decode is None:
            pad_decode = use_graphs
        buckets = decode_buckets(max_num_seqs) if pad_decode else list(range(1, max_num_seqs + 1))
        self.max_num_seqs = max_num_seqs
        self._verify_widths = sorted({0, verify_width}) if pad_decode else list(range(verify_width + 1))
        max_query_len = 1 + verify_width
        self._context_bounds = context_buckets(max_context)
        self._buffers = StepBuffers(buckets, -(-max_context // self.block_size), self.device, max_query_len)
        self._logits = torch.zeros(max_num_seqs * max_query_len, config.vocab_size, dtype=torch.float32, device=self.device)
        self._graphs: DecodeGraphs | None = None
        if use_graphs:
            self._graphs = DecodeGraphs(
                self._forward_decode,
                self._buffers,
                [1 + width for width in self._verify_widths],
                self._context_bounds,
                self.block_size,
                self._decode_plan_key,
            )
            with torch.inference_mode():
                self._graphs.capture()

    def _decode_plan_key(self, rows: int, q: int, bound: int) -> tuple:
        """The paged decode kernel's launch plans at ``rows`` rows and context bound ``bound``,
        one per distinct sliding window; a one-partition plan's length is dropped (any length
        covering the context computes the same). ``q`` query tokens per row (a verify step)
        share the kernel's programs."""
        from conveyor.kernels.paged_decode import plan_decode_partitions
        config = self.model_config
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        windows = sorted({layer.sliding_window or 0 for layer in self.model.attention_layers()})
        plans = []
        for window in windows:
            plan = plan_decode_partitions(
                batch=rows,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                dtype=self.dtype,
                max_context=min(bound, window + q - 1) if window else bound,
                num_sms=num_sms,
                query_len=q,
            )
            plans.append(plan if plan.num_partitions > 1 else dataclasses.replace(plan, partition_size=0))
        return tuple(plans)


def _scored(tokens: torch.Tensor, inputs: DecodeInputs) -> torch.Tensor:
    """``tokens`` (one entry per query token) in ``inputs.logit_index`` order: each row's last
    real token, then the proposal positions; ``q == 1`` has no proposals and its rows are
    already in that order (a padded row's entry is unread), so nothing is gathered."""
    return tokens if inputs.query_len == 1 else tokens.index_select(0, inputs.logit_index)
