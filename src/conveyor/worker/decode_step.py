"""The decode step: every row runs one token (or its last token and a proposal of up to ``k``,
a verify step), through static buffers and CUDA graphs.

A busy server's steps are mostly decodes, so they do not build their inputs afresh: the batch
is padded to a bucket of rows, staged on the host and copied in one go into persistent device
buffers (:mod:`conveyor.worker.step_buffers`), and the forward over them is replayed from a
CUDA graph (:mod:`conveyor.worker.cuda_graphs`) or run eagerly (docs/architecture.md, "The
decode step").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from conveyor import profiling
from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.attention.triton_backend import TritonPagedAttention
from conveyor.worker.cuda_graphs import DecodeGraphs
from conveyor.worker.parallel import broadcast_from_first_
from conveyor.worker.request_state import Work
from conveyor.worker.sampler import batch_of_columns, host_flags
from conveyor.worker.sampling_controls import ControlSelection
from conveyor.worker.step_buffers import DecodeInputs, StepBuffers, context_buckets, decode_buckets, smallest_fitting
from conveyor.worker.step_parts import StepParts
from conveyor.worker.step_state import StepOutput, StepRows


@dataclass(eq=False)
class StagedStep:
    """A decode step's inputs staged on the host for a bucket of ``rows`` rows of ``q``
    tokens, and what the host keeps of them: ``bound`` (an upper bound on every row's
    context, which fixes the decode kernel's partitioning) and the table ``width`` it gives;
    the position of the token each real row draws; how many proposal positions are scored
    (``targets``); the sampling rows' controls and filter flags; the attention lengths the
    torch backends read on the host; whether a row's input is on the device only."""

    rows: int
    q: int
    bound: int
    width: int
    draws: np.ndarray
    targets: int
    selection: ControlSelection | None
    flags: dict[str, bool]
    seq_lens_host: list[int]
    from_device: bool


class DecodeStep:
    """The decode-only step of a runner over ``parts``: static decode buffers for up to
    ``max_num_seqs`` rows of up to ``1 + verify_width`` query tokens, for contexts within the
    pool of ``num_blocks`` and the model's positions, and on CUDA (unless ``enforce_eager``,
    with the Triton backend and no tensor parallelism) their graphs.

    Decode batches pad to the graph buckets (:func:`decode_buckets`) when graphs replay
    them; run eagerly, padding would only add rows of work (a third more at worst on a CPU,
    which is compute-bound), so every row count is its own bucket, unless ``pad_decode`` says
    otherwise (tests exercise padding on CPU with it). Likewise a verify step pads its
    proposals to the fixed ``verify_width`` (one graph per bucket and width: 0 and
    ``verify_width``), or eagerly unpadded to its longest proposal."""

    def __init__(
        self, parts: StepParts, *, max_num_seqs: int, num_blocks: int, enforce_eager: bool, pad_decode: bool | None,
        backend: AttentionBackend, verify_width: int = 0,
    ) -> None:  # fmt: skip
        self.parts = parts
        model, block_size, device = parts.model, parts.block_size, parts.device
        self.config = config = model.config
        # The longest context a decode row can have: the pool, and the model's positions.
        max_context = min(num_blocks, -(-config.max_position_embeddings // block_size)) * block_size
        use_graphs = (
            device.type == "cuda"
            and not enforce_eager
            and isinstance(backend, TritonPagedAttention)
            and parts.tensor_parallel.size == 1
        )
        if pad_decode is None:
            pad_decode = use_graphs
        buckets = decode_buckets(max_num_seqs) if pad_decode else list(range(1, max_num_seqs + 1))
        self.max_num_seqs = max_num_seqs
        self.verify_widths = sorted({0, verify_width}) if pad_decode else list(range(verify_width + 1))
        max_query_len = 1 + verify_width
        self.context_bounds = context_buckets(max_context)
        self.buffers = StepBuffers(buckets, -(-max_context // block_size), device, max_query_len)
        self.logits = torch.zeros(max_num_seqs * max_query_len, config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            widths = [1 + width for width in self.verify_widths]
            self.graphs = DecodeGraphs(
                self.forward, self.buffers, widths, self.context_bounds, block_size, self.plan_key
            )
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """(Re)capture the decode graphs, if this step uses them: at start, on waking from a
        sleep (the caches and weights have new addresses) and after an 8-bit KV cache's scales
        change (the kernels take them as values, which a graph holds)."""
        if self.graphs is None:
            return
        self.graphs.release()
        with torch.inference_mode():
            self.graphs.capture()

    def release_graphs(self) -> None:
        """Drop the decode graphs and their memory pool (a sleep); :meth:`capture_graphs` makes them again."""
        if self.graphs is not None:
            self.graphs.release()

    def static_query_len(self, work: list[Work]) -> int | None:
        """The query tokens per row ``q`` of a step that can run through the static buffers:
        every row a decode, with a proposal of at most the runner's verify width (one token and
        no proposal: ``q == 1``), and every row's ``q`` positions inside the buffers' context.
        ``q - 1`` is the step's verify width ``k``: the longest proposal rounded up to one of
        ``verify_widths`` (with graphs, 0 or the configured width). None: the ragged path."""
        longest = 0
        for item in work:
            if item.num_scheduled != 1 + len(item.proposal):
                return None
            longest = max(longest, len(item.proposal))
        if longest > self.verify_widths[-1]:
            return None
        q = 1 + smallest_fitting(self.verify_widths, longest)
        if max(item.num_computed for item in work) + q > self.context_bounds[-1]:
            return None
        return q

    def run(self, rows: StepRows, q: int) -> StepOutput:
        """A decode or decode-verify step (``q`` tokens per row, from :meth:`static_query_len`)
        through the static buffers: stage every input on the host, one copy to the device, then
        the captured graph of the step's bucket (or the same forward run eagerly), then the
        sampler over the bucket's rows; padded rows, and padded positions of rows whose proposal
        is shorter than ``q - 1``, are ignored (no KV stored, outputs never read)."""
        parts = self.parts
        start = profiling.now_ns()
        staged = self._stage(rows, q)
        inputs = self.buffers.upload(staged.rows, staged.width, q)
        if staged.from_device:
            first_ids = inputs.input_ids.view(staged.rows, q)[:, 0]
            first_ids.copy_(torch.where(inputs.from_device, parts.last_tokens.tokens[inputs.last_slots], first_ids))
        # Graphs are captured without adapters: a step with adapter rows runs eagerly.
        with parts.adapters.step(rows.states, np.full(staged.rows, q, dtype=np.int64)) as with_adapters:
            start = parts.timers.prepare.record(start)
            if self.graphs is not None and not with_adapters:
                self.graphs.replay(staged.rows, q, staged.bound)
            else:
                self.forward(inputs, staged.bound, staged.seq_lens_host)
        start = parts.timers.forward.record(start)
        out = self._sample(rows, staged, inputs)
        parts.timers.sample.record(start)
        return out

    def _stage(self, rows: StepRows, q: int) -> StagedStep:
        """Every input of the step into the host staging buffer of its bucket: a row runs its
        last known token then its proposal, padded to ``q``; it samples after its last real
        token and, for a verify, its proposal positions are scored too."""
        work, slots = rows.work, rows.slots
        n = len(work)
        bucket = self.buffers.bucket_for(n)
        computed = np.fromiter([item.num_computed for item in work], np.int64, n)
        lengths = np.fromiter([len(item.proposal) for item in work], np.int64, n)  # proposal tokens per row
        max_seq_len = int(computed.max()) + q
        if self.graphs is not None:
            bound = self.graphs.bound_for(bucket, q, max_seq_len)
        else:
            bound = smallest_fitting(self.context_bounds, max_seq_len)
        width = -(-bound // self.parts.block_size)
        host = self.buffers.stage(bucket, width, q)
        from_device = self._stage_tokens(host, rows, bucket, q, lengths)
        self._stage_attention(host, slots, width, q, computed, lengths)
        targets = _stage_scored(host, bucket, q, lengths)
        draws = computed + lengths + 1  # the position of the token each row draws
        selection, flags = self._stage_sampling(host, rows, draws)
        seq_lens_host = host["seq_lens"].tolist()  # the torch backends' host lengths (before the buffer is reused)
        return StagedStep(bucket, q, bound, width, draws, targets, selection, flags, seq_lens_host, from_device)

    def _stage_tokens(
        self, host: dict[str, np.ndarray], rows: StepRows, bucket: int, q: int, lengths: np.ndarray
    ) -> bool:
        """Each row's last known token then its proposal; a token the host has not read yet
        (sampled by the step in flight) is marked to be read from the device. Whether any is."""
        work, states = rows.work, rows.states
        n = len(work)
        pending = np.fromiter(
            [item.num_computed >= len(state.token_ids) for item, state in zip(work, states)], np.bool_, n
        )
        token_ids = host["input_ids"].reshape(bucket, q)
        token_ids[:n, 0] = [
            0 if late else state.token_ids[item.num_computed] for item, state, late in zip(work, states, pending)
        ]
        for row in np.flatnonzero(lengths).tolist():
            token_ids[row, 1 : 1 + lengths[row]] = work[row].proposal
        host["from_device"][:n] = pending
        host["last_slots"][:n] = rows.slots
        return bool(pending.any())

    def _stage_attention(
        self,
        host: dict[str, np.ndarray],
        slots: np.ndarray,
        width: int,
        q: int,
        computed: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Positions, KV slots, block tables and lengths. A padded position repeats its row's
        last real position (a valid rotary position); its KV is not stored (slot -1) and its
        output is never read."""
        n, block_size = len(slots), self.parts.block_size
        offsets = np.arange(q)[None, :]
        real = offsets <= lengths[:, None]
        positions = computed[:, None] + np.minimum(offsets, lengths[:, None])
        host["positions"].reshape(-1, q)[:n] = positions
        tables = self.parts.requests.tables[slots]
        columns = min(width, tables.shape[1])
        host["block_tables"][:n, :columns] = tables[:, :columns]
        blocks = np.take_along_axis(tables, positions // block_size, axis=1)
        host["slot_mapping"].reshape(-1, q)[:n] = np.where(real, blocks * block_size + positions % block_size, -1)
        host["seq_lens"][:n] = computed + q
        host["context_lens"][:n] = computed

    def _stage_sampling(
        self, host: dict[str, np.ndarray], rows: StepRows, draws: np.ndarray
    ) -> tuple[ControlSelection | None, dict[str, bool]]:
        """Which rows sample, their slots, the rows using sampling controls and every row's
        sampling parameters; the controls' selection and the sampling rows' filter flags."""
        parts, slots, sample_rows = self.parts, rows.slots, rows.sample_rows
        m = len(sample_rows)
        host["sample_rows"][:m] = sample_rows
        host["sample_slots"][:m] = slots[sample_rows]
        selection = parts.controls.select(slots[sample_rows], draws[sample_rows])
        if selection is not None:
            c = len(selection.rows)
            host["control_rows"][:c] = sample_rows[selection.rows]
            host["control_pool_rows"][:c] = selection.pool_rows
        params = parts.sampling.gather(slots)
        for name, column in params.items():
            host[name][: len(slots)] = column
        flags = host_flags({name: column[sample_rows] for name, column in params.items()}, self.config.vocab_size)
        return selection, flags

    def _sample(self, rows: StepRows, staged: StagedStep, inputs: DecodeInputs) -> StepOutput:
        """The sampled ids of the sampling rows, on every rank (rank 0 samples, the others
        receive its ids)."""
        parts, m = self.parts, len(rows.sample_rows)
        if parts.tensor_parallel.rank == 0:
            out = self._sample_here(rows, staged, inputs)
        else:
            out = StepOutput(torch.empty(m, dtype=torch.int64, device=parts.device), inputs.sample_slots[:m])
        broadcast_from_first_(out.sampled, parts.tensor_parallel)
        return out

    def _sample_here(self, rows: StepRows, staged: StagedStep, inputs: DecodeInputs) -> StepOutput:
        """Rank 0's part: the sampler over the bucket's logits, then, for the rows that ask, the
        log-probabilities; a verify's proposal positions go to the verification as the ragged
        path's do."""
        parts, slots, sample_rows = self.parts, rows.slots, rows.sample_rows
        m = len(sample_rows)
        controls, selection = None, staged.selection
        if selection is not None:
            c = len(selection.rows)
            controls = parts.controls.rows_of(selection, inputs.control_rows[:c], inputs.control_pool_rows[:c])
        draw_positions = _scored(inputs.positions, inputs)[: staged.rows] + 1
        batch = batch_of_columns(inputs.tensors, draw_positions, staged.flags, controls)
        ends = parts.grammar.constrain(batch, rows, False, staged.rows)
        sampled = parts.sampler.sample(self.logits[: staged.rows], batch).index_select(0, inputs.sample_rows[:m])
        # After the graph, on the same logits, for the rows that ask (the host knows which).
        logprobs = parts.logprobs.sampled(
            self.logits, sample_rows, sampled, slots[sample_rows], staged.draws[sample_rows]
        )
        verdict = None
        if staged.targets:
            targets = self.logits.index_select(0, inputs.target_index[: staged.targets])
            verdict = parts.verifier.verify(targets, rows.work, slots)
        return StepOutput(sampled, inputs.sample_slots[:m], logprobs, None, verdict, ends)

    def forward(self, inputs: DecodeInputs, bound: int, seq_lens_host: list[int] | None = None) -> None:
        """Embedding to logits of a decode bucket, reading only ``inputs`` (fixed device views)
        and writing ``self.logits[:rows * q]`` (rank 0) in ``inputs.logit_index`` order: what
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
            block_size=self.parts.block_size,
            query_start_loc_host=list(range(0, rows * q + 1, q)),
            seq_lens_host=seq_lens_host if seq_lens_host is not None else [q] * rows,
            uniform_query=True,
        )
        model = self.parts.model
        hidden = model(inputs.input_ids, inputs.positions, metadata)
        if self.parts.tensor_parallel.rank == 0:
            self.logits[: rows * q].copy_(model.compute_logits(_scored(hidden, inputs)))

    def plan_key(self, rows: int, q: int, bound: int) -> tuple:
        """The paged decode kernel's launch plans at ``rows`` rows and context bound ``bound``,
        one per distinct sliding window; a one-partition plan's length is dropped (any length
        covering the context computes the same). ``q`` query tokens per row (a verify step)
        share the kernel's programs."""
        from conveyor.kernels.paged_decode import plan_decode_partitions

        config, model = self.config, self.parts.model
        num_sms = torch.cuda.get_device_properties(self.parts.device).multi_processor_count
        windows = sorted({layer.sliding_window or 0 for layer in model.attention_layers()})
        plans = []
        for window in windows:
            plan = plan_decode_partitions(
                batch=rows,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                dtype=model.dtype,
                max_context=min(bound, window + q - 1) if window else bound,
                num_sms=num_sms,
                query_len=q,
            )
            plans.append(plan if plan.num_partitions > 1 else dataclasses.replace(plan, partition_size=0))
        return tuple(plans)


def _stage_scored(host: dict[str, np.ndarray], bucket: int, q: int, lengths: np.ndarray) -> int:
    """The hidden rows the LM head scores (each row's last real token, then every row's
    first ``q - 1`` positions) and, among those, the real proposal positions; their count."""
    n = len(lengths)
    firsts = np.arange(bucket) * q
    offsets = np.arange(q)[None, :]
    host["logit_index"][:n] = firsts[:n] + lengths
    host["logit_index"][bucket:] = (firsts[:, None] + offsets[:, :-1]).ravel()
    targets = np.concatenate(
        [bucket + row * (q - 1) + np.arange(lengths[row]) for row in np.flatnonzero(lengths).tolist()] or [[]]
    )
    host["target_index"][: len(targets)] = targets
    return len(targets)


def _scored(tokens: torch.Tensor, inputs: DecodeInputs) -> torch.Tensor:
    """``tokens`` (one entry per query token) in ``inputs.logit_index`` order: each row's last
    real token, then the proposal positions; ``q == 1`` has no proposals and its rows are
    already in that order (a padded row's entry is unread), so nothing is gathered."""
    return tokens if inputs.query_len == 1 else tokens.index_select(0, inputs.logit_index)
