"""Executes the scheduler's :class:`StepPlan` on the device: one flattened forward per step.

The runner keeps what the worker must remember between steps, per request: every known
token (the prompt, then what it sampled), the block table and the sampling parameters.
Plans name requests by *slot* (see :mod:`conveyor.ipc.messages`), so that state lives
in a list indexed by slot, as long as the largest slot seen. The scheduler stays the
authority on blocks, slots and how many tokens run; the runner checks that each plan is
consistent with what it holds and refuses one that is not, before it changes any state
(apart from dropping the plan's finished slots, which comes first).

Per step, the new tokens of every scheduled request are laid end to end (no padding to the
longest) and run as one batch; a request samples when the step computes its last known
token, and the sampled token is appended to its tokens here, since the scheduler does not
send it back.

**Launch and finish.** A step is two calls: :meth:`ModelRunner.launch` checks the plan,
prepares its inputs and enqueues the forward and the sampling on the device;
:meth:`ModelRunner.finish` waits for that step's sampled tokens and builds the result
(:meth:`execute` is the two in a row). Between them the worker may launch the next plan, so
that on a GPU the next step is queued before the host waits for this one's tokens and the
device never idles while Python handles a result. The next step's decode inputs are tokens
the device has sampled but the host has not seen yet: every step scatters its samples into
a per-slot buffer on the device (``_last_tokens``), and a launch reads a row's last input
from there when the host does not have it (the row's state counts it in ``pending``). The
sampled ids come back through a host buffer copied without blocking the stream (pinned on
CUDA) and an event, not through a ``.tolist()`` that would wait for the next step too.
At most one step is launched and not finished when another is launched.

**The decode step** (every row runs one token) does not build its inputs afresh: it pads the
batch to a bucket of rows and fills persistent device buffers from one pinned staging buffer
in one copy (:mod:`conveyor.worker.step_buffers`), then runs the forward over them: replayed
from a CUDA graph captured at startup (:mod:`conveyor.worker.cuda_graphs`), or eagerly (CPU,
``enforce_eager``). Prefill, chunked prefill and mixed steps run the flattened ragged batch.
Sampling is batched over per-row parameter tensors (:mod:`conveyor.worker.sampler`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from conveyor import profiling
from conveyor.ipc.messages import MAX_SLOTS, SamplingParams, StepPlan, StepResult, int_list
from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata, token_positions
from conveyor.worker.attention.triton_backend import TritonPagedAttention, backend_for
from conveyor.worker.block_transfer import transfer_blocks
from conveyor.worker.cuda_graphs import DecodeGraphs
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.loader import load_model
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel, broadcast_from_first_
from conveyor.worker.sampler import Sampler, SamplingColumns, batch_from_rows, batch_of_columns, host_flags
from conveyor.worker.step_buffers import DecodeInputs, StepBuffers, context_buckets, decode_buckets, smallest_fitting


class PlanRefused(ValueError):
    """A plan the runner refuses before it changes any state or runs anything on the device
    (it contradicts the runner's state, or was planned ahead of a step that failed). Raised
    alike on every tensor-parallel rank, before any collective, so the ranks stay in step and
    only that step fails; any other error of a rank leaves the ranks out of step."""


@dataclass
class _RequestState:
    """Invariant: ``num_computed <= len(token_ids)``, and the KV of tokens
    ``0..num_computed-1`` is in the cache blocks ``block_ids`` name. ``request_id`` is only
    for messages: plans name the request by its slot."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    sampling: SamplingParams
    num_computed: int
    pending: int = 0  # tokens sampled by a launched step, not yet appended (0 or 1)

    @property
    def num_known(self) -> int:
        return len(self.token_ids) + self.pending


@dataclass(frozen=True)
class _Work:
    """One request's share of a validated step: run tokens ``num_computed .. num_computed +
    num_scheduled - 1`` after appending ``new_block_ids`` to its table."""

    slot: int
    num_computed: int
    num_scheduled: int
    new_block_ids: list[int]


@dataclass
class LaunchedStep:
    """A step enqueued on the device, waiting for :meth:`ModelRunner.finish`."""

    step_id: int
    planned_ahead: bool
    slots: list[int]  # the slots that sample, in result order
    states: list[_RequestState]  # their states (held here: a later plan may drop the slots)
    sampled: torch.Tensor | None  # host buffer the sampled ids are copied into
    done: torch.cuda.Event | None  # recorded after that copy (CUDA only)
    start: float  # perf_counter at launch


class ModelRunner:
    """The model, its KV cache, the sampler and per-request state of one worker.

    Give exactly one of ``num_blocks`` and ``kv_cache_memory_bytes`` (the pool then holds as
    many blocks as fit in that many bytes). ``attention`` picks the backend: ``auto`` (Triton
    on CUDA, torch on CPU), ``triton`` or ``torch``. ``num_cpu_blocks`` (or
    ``swap_space_bytes``) sizes the CPU swap space that plans' swap-outs and swap-ins use.
    ``max_num_seqs`` (the scheduler's) bounds the rows of a step and sizes the static decode
    buffers; on CUDA the decode step is captured as CUDA graphs unless ``enforce_eager``.
    ``pad_decode``: pad decode batches to the graph buckets (default: when graphs are used).

    ``tensor_parallel``: this runner is one rank of a tensor-parallel group
    (:mod:`conveyor.worker.parallel`). It holds the rank's shard of the model and a cache of
    its kv heads (``kv_cache_memory_bytes`` is then this rank's budget); only rank 0 computes
    logits and samples, and broadcasts the ids, so every rank returns the same results and
    keeps the same request state. Every rank must be given the same plans.
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        attention: str = "auto",
        profiler: profiling.Profiler | None = None,
        num_cpu_blocks: int | None = None,
        swap_space_bytes: int | None = None,
        tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
        max_num_seqs: int = 256,
        enforce_eager: bool = False,
        pad_decode: bool | None = None,
    ) -> None:
        if (num_blocks is None) == (kv_cache_memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_cache_memory_bytes")
        self.device = torch.device(device)
        self.block_size = block_size
        self.tensor_parallel = tp = tensor_parallel
        backend = backend_for(self.device, attention)
        self.model, self.model_config = load_model(model_dir, self.device, dtype, backend, tp)
        self.dtype = self.model.embed_tokens.weight.dtype
        cache_shape = KVCacheShape.of(self.model_config, block_size, self.dtype, tp)
        self.block_bytes = cache_shape.bytes_per_block
        if num_blocks is None:
            num_blocks = kv_cache_memory_bytes // self.block_bytes
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes={kv_cache_memory_bytes} is less than one block ({self.block_bytes} bytes)"
                )
        self.num_blocks = num_blocks
        self.kv_caches = cache_shape.allocate(num_blocks, self.device)
        self.model.bind_kv_cache(self.kv_caches)
        if num_cpu_blocks is None:
            num_cpu_blocks = (swap_space_bytes or 0) // self.block_bytes
        self.num_cpu_blocks = num_cpu_blocks
        self.swap_caches = cache_shape.allocate_swap(num_cpu_blocks, self.device)
        self.sampler = Sampler(self.device)
        self._sampling = SamplingColumns()  # per-slot sampling parameters, set when a request arrives
        # Request state by slot; None: a free slot. Grows to the largest slot seen (at most the
        # scheduler's max_num_seqs), never shrinks. _last_tokens (on the device) grows with it.
        self._states: list[_RequestState | None] = []
        self._last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        # Every held slot's block table, row = slot (a copy of its state's block_ids, zero
        # past them): a step's tables are then one gather of its rows, not a copy per row.
        self._tables = np.zeros((0, 0), dtype=np.int64)
        self._failed = False  # the last step raised: a plan planned ahead of it fails too
        self._cuda = self.device.type == "cuda"
        # Host buffers the sampled ids land in, two so that a step can be launched while the
        # previous one's are still unread (pinned on CUDA, so the copy does not block).
        self._sampled_host: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64) for _ in range(2)]
        self._next_buffer = 0
        # Stage timers of a step's launch. On CUDA, kernels run asynchronously: these are
        # then host (launch) times, and the device's time shows in the worker's "wait_tokens".
        prof = profiler or profiling.Profiler("worker", enabled=False)
        self._t_prepare = prof.timer("prepare_inputs")
        self._t_forward = prof.timer("forward")
        self._t_sample = prof.timer("sample")  # LM head on the sampled rows + the sampler
        self._t_swap = prof.timer("swap", arg_name="blocks")  # only steps that copy blocks
        self._setup_decode_step(max_num_seqs, enforce_eager, pad_decode, backend)

    @property
    def slots(self) -> list[int]:
        """The slots whose request state the runner holds, in increasing order."""
        return [slot for slot, state in enumerate(self._states) if state is not None]

    @property
    def request_ids(self) -> list[str]:
        """The ids of the requests whose state the runner holds, in slot order."""
        return [state.request_id for state in self._states if state is not None]

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: :meth:`launch` then :meth:`finish`. Raises like :meth:`launch`."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Check the plan, update the requests' state and enqueue the step on the device.

        Raises PlanRefused, changing nothing but dropping the finished slots, if the plan
        contradicts the runner's state, or was planned ahead of a step that failed. At most one
        launched step may be unfinished when this is called.
        """
        failed_before, self._failed = self._failed, True  # cleared once this step is launched
        self._drop(int_list(plan.finished_slots))
        if plan.planned_ahead and failed_before:
            raise PlanRefused(f"step {plan.step_id} was planned ahead of step {plan.step_id - 1}, which failed")
        work = self._validate(plan)
        # Copies out before copies in, both before the forward: a GPU block swapped out may
        # be the destination of a swap-in or of new KV in this same plan (see StepPlan).
        if plan.swap_out or plan.swap_in:
            swap_start = profiling.now_ns()
            transfer_blocks(self.kv_caches, self.swap_caches, plan.swap_out)
            transfer_blocks(self.swap_caches, self.kv_caches, plan.swap_in)
            self._t_swap.record(swap_start, arg=len(plan.swap_out) + len(plan.swap_in))
        table = self._states
        for new in plan.new_requests:  # on free slots (checked), the finished ones dropped above
            if new.slot >= len(table):
                table.extend([None] * (new.slot + 1 - len(table)))
            tokens, blocks = int_list(new.token_ids), int_list(new.block_ids)
            table[new.slot] = _RequestState(new.request_id, tokens, blocks, new.sampling, new.num_computed_tokens)
            self._sampling.set(new.slot, new.sampling)
            self._set_table(new.slot, 0, blocks, clear=True)
        if len(self._last_tokens) < len(table):
            grown = torch.zeros(len(table), dtype=torch.int64, device=self.device)
            grown[: len(self._last_tokens)] = self._last_tokens
            self._last_tokens = grown
        start = time.perf_counter()
        states = [table[item.slot] for item in work]
        for item, state in zip(work, states):
            if item.new_block_ids:
                self._set_table(item.slot, len(state.block_ids), item.new_block_ids)
                state.block_ids.extend(item.new_block_ids)
        samples = [item.num_computed + item.num_scheduled == state.num_known for item, state in zip(work, states)]
        sampled, sample_slots = self._run(work, states, samples) if work else (None, None)
        for item, state in zip(work, states):
            state.num_computed += item.num_scheduled
        sampling = [(item.slot, state) for item, state, flag in zip(work, states, samples) if flag]
        launched = LaunchedStep(
            plan.step_id, plan.planned_ahead, [slot for slot, _ in sampling], [state for _, state in sampling],
            None, None, start,
        )
        if sampling:
            for _, state in sampling:
                state.pending += 1
            # the next steps' inputs, without a host round trip
            self._last_tokens.index_copy_(0, sample_slots, sampled)
            launched.sampled = self._copy_to_host(sampled)
            if self._cuda:
                launched.done = torch.cuda.Event()
                launched.done.record()
        self._failed = False
        return launched

    def _set_table(self, slot: int, start: int, blocks: list[int], clear: bool = False) -> None:
        """Write ``blocks`` into slot's block table row from column ``start`` (growing the
        table as needed); ``clear`` zeroes the rest of the row (a new request on the slot)."""
        tables = self._tables
        rows, cols = tables.shape
        end = start + len(blocks)
        if slot >= rows or end > cols:
            new_rows = rows if slot < rows else max(slot + 1, 2 * rows)
            new_cols = cols if end <= cols else max(end, 2 * cols)
            grown = np.zeros((new_rows, new_cols), dtype=np.int64)
            grown[:rows, :cols] = tables
            self._tables = tables = grown
        if clear:
            tables[slot, end:] = 0
        tables[slot, start:end] = blocks

    def _copy_to_host(self, sampled: torch.Tensor) -> torch.Tensor:
        """Start copying the sampled ids into the next host buffer (pinned on CUDA: the copy is
        queued behind the step and does not wait for what is launched after it)."""
        n = sampled.shape[0]
        k = self._next_buffer
        self._next_buffer = 1 - k
        buffer = self._sampled_host[k]
        if buffer.shape[0] < n:
            size = max(n, 2 * buffer.shape[0], 64)
            buffer = torch.zeros(size, dtype=torch.int64, pin_memory=self._cuda)
            self._sampled_host[k] = buffer
        out = buffer[:n]
        out.copy_(sampled, non_blocking=self._cuda)
        return out

    def step_done(self, launched: LaunchedStep) -> bool:
        """Whether :meth:`finish` would return at once (the device has sampled the step)."""
        return launched.done is None or launched.done.query()

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's sampled ids, append them to the requests' tokens and
        return the step's result. Launched steps are finished in launch order."""
        try:
            if launched.done is not None:
                launched.done.synchronize()
            tokens = launched.sampled.tolist() if launched.sampled is not None else []
        except Exception:
            self._failed = True  # (a device error) a plan planned ahead of this step fails too
            raise
        for state, token in zip(launched.states, tokens):
            state.token_ids.append(token)
            state.pending -= 1
        return StepResult(
            launched.step_id, launched.slots, tokens, forward_time=time.perf_counter() - launched.start
        )

    def _run(
        self, work: list[_Work], states: list[_RequestState], samples: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward the step and sample; returns, on the device, the ids sampled for the rows with
        ``samples`` set, in order, and their slots (nothing here waits for the device). A
        decode-only step (every row runs one token) takes the static-buffer path
        (:meth:`_run_decode`), any other the flattened ragged one (:meth:`_run_ragged`)."""
        if all(item.num_scheduled == 1 for item in work):
            return self._run_decode(work, states, samples)
        return self._run_ragged(work, states, samples)

    def _run_ragged(
        self, work: list[_Work], states: list[_RequestState], samples: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill, chunked prefill and mixed steps: the new tokens laid end to end, unpadded."""
        start = profiling.now_ns()
        query_lens = [item.num_scheduled for item in work]
        context_lens = [item.num_computed for item in work]
        input_ids: list[int] = []
        on_device: list[tuple[int, int]] = []  # (flat index, slot): inputs sampled by the step in flight
        for item, state in zip(work, states):
            end = item.num_computed + item.num_scheduled
            known = state.token_ids
            if end > len(known):  # its last input is the pending token: only the device has it
                on_device.append((len(input_ids) + item.num_scheduled - 1, item.slot))
                input_ids += known[item.num_computed : end]
                input_ids.append(0)
            else:
                input_ids += known[item.num_computed : end]
        slots = np.fromiter([item.slot for item in work], np.int64, len(work))
        tables = self._tables[slots]
        metadata = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, self.device)
        positions = torch.from_numpy(token_positions(query_lens, context_lens)).to(self.device, non_blocking=True)
        tokens = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if on_device:
            index, pending = torch.tensor(on_device, dtype=torch.int64).to(self.device, non_blocking=True).unbind(1)
            tokens[index] = self._last_tokens[pending]
        start = self._t_prepare.record(start)
        hidden = self.model(tokens, positions, metadata)
        start = self._t_forward.record(start)

        sample_rows = np.flatnonzero(samples)
        sample_slots = torch.from_numpy(slots[sample_rows]).to(self.device, non_blocking=True)
        if self.tensor_parallel.rank == 0:
            ends = np.asarray(metadata.query_start_loc_host[1:], dtype=np.int64)
            logits = self.model.compute_logits(hidden[torch.from_numpy(ends[sample_rows] - 1).to(self.device)])
            # The position of the token being drawn is fixed for each output index of a request,
            # so it keys a seeded draw as well as the output index would, across preemptions too.
            draw_positions = np.fromiter([item.num_computed + item.num_scheduled for item in work], np.int64, len(work))
            batch = batch_from_rows(
                self._sampling.gather(slots[sample_rows]), draw_positions[sample_rows], logits.shape[1], self.device
            )
            sampled = self.sampler.sample(logits, batch)
        else:  # rank 0 holds the LM head and samples; the next steps' inputs need its ids here too
            sampled = torch.empty(len(sample_rows), dtype=torch.int64, device=self.device)
        broadcast_from_first_(sampled, self.tensor_parallel)
        self._t_sample.record(start)
        return sampled, sample_slots

    def _run_decode(
        self, work: list[_Work], states: list[_RequestState], samples: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step through the static buffers: stage every input on the host, one
        copy to the device, then the captured graph of the step's bucket (or the same forward
        run eagerly), then the sampler over the bucket's rows; padded rows are ignored."""
        start = profiling.now_ns()
        n = len(work)
        rows = self._buffers.bucket_for(n)
        slots = np.fromiter([item.slot for item in work], np.int64, n)
        computed = np.fromiter([item.num_computed for item in work], np.int64, n)
        max_seq_len = int(computed.max()) + 1
        if self._graphs is not None:
            bound = self._graphs.bound_for(rows, max_seq_len)
        else:
            bound = smallest_fitting(self._context_bounds, max_seq_len)
        width = -(-bound // self.block_size)
        host = self._buffers.stage(rows, width)
        pending = np.fromiter(
            [item.num_computed >= len(state.token_ids) for item, state in zip(work, states)], np.bool_, n
        )
        host["input_ids"][:n] = [
            0 if late else state.token_ids[item.num_computed] for item, state, late in zip(work, states, pending)
        ]
        host["from_device"][:n] = pending
        host["last_slots"][:n] = slots
        host["positions"][:n] = computed
        tables = self._tables[slots]
        columns = min(width, tables.shape[1])
        host["block_tables"][:n, :columns] = tables[:, :columns]
        blocks = tables[np.arange(n), computed // self.block_size]
        host["slot_mapping"][:n] = blocks * self.block_size + computed % self.block_size
        host["seq_lens"][:n] = computed + 1
        host["context_lens"][:n] = computed
        sample_rows = np.flatnonzero(samples)
        m = len(sample_rows)
        host["sample_rows"][:m] = sample_rows
        host["sample_slots"][:m] = slots[sample_rows]
        params = self._sampling.gather(slots)
        for name, column in params.items():
            host[name][:n] = column
        flags = host_flags({name: column[sample_rows] for name, column in params.items()}, self.model_config.vocab_size)
        seq_lens_host = host["seq_lens"].tolist()  # the torch backends' host lengths (before the buffer is reused)
        inputs = self._buffers.upload(rows, width)
        if pending.any():
            inputs.input_ids.copy_(
                torch.where(inputs.from_device, self._last_tokens[inputs.last_slots], inputs.input_ids)
            )
        start = self._t_prepare.record(start)
        if self._graphs is not None:
            self._graphs.replay(rows, bound)
        else:
            self._forward_decode(inputs, bound, seq_lens_host)
        start = self._t_forward.record(start)

        sample_slots = inputs.sample_slots[:m]
        if self.tensor_parallel.rank == 0:
            # inputs.positions + 1: the position of the token being drawn
            batch = batch_of_columns(inputs.tensors, inputs.positions + 1, flags)
            sampled = self.sampler.sample(self._logits[:rows], batch).index_select(0, inputs.sample_rows[:m])
        else:
            sampled = torch.empty(m, dtype=torch.int64, device=self.device)
        broadcast_from_first_(sampled, self.tensor_parallel)
        self._t_sample.record(start)
        return sampled, sample_slots

    def _forward_decode(self, inputs: DecodeInputs, bound: int, seq_lens_host: list[int] | None = None) -> None:
        """Embedding to logits of a decode bucket, reading only ``inputs`` (fixed device views)
        and writing ``self._logits[:rows]`` (rank 0): what the CUDA graphs capture.

        ``bound`` is an upper bound on every row's context: it fixes the decode kernel's
        partitioning. ``seq_lens_host`` (the staged lengths) serves the torch backends, which
        plan on the host; captured graphs never read it (padding's lengths stand in)."""
        rows = inputs.rows
        metadata = AttentionMetadata(
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            context_lens=inputs.context_lens,
            block_tables=inputs.block_tables,
            slot_mapping=inputs.slot_mapping,
            max_seq_len=bound,
            max_query_len=1,
            block_size=self.block_size,
            query_start_loc_host=list(range(rows + 1)),
            seq_lens_host=seq_lens_host if seq_lens_host is not None else [1] * rows,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, metadata)
        if self.tensor_parallel.rank == 0:
            self._logits[:rows].copy_(self.model.compute_logits(hidden))

    def _setup_decode_step(
        self, max_num_seqs: int, enforce_eager: bool, pad_decode: bool | None, backend: AttentionBackend
    ) -> None:
        """Static decode buffers for up to ``max_num_seqs`` rows, and on CUDA (unless
        ``enforce_eager``, with the Triton backend and no tensor parallelism) their graphs.

        Decode batches pad to the graph buckets (:func:`decode_buckets`) when graphs replay
        them; run eagerly, padding would only add rows of work (a third more at worst on a
        CPU, which is compute-bound), so every row count is its own bucket, unless
        ``pad_decode`` says otherwise (tests exercise padding on CPU with it)."""
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
        self._context_bounds = context_buckets(max_context)
        self._buffers = StepBuffers(buckets, -(-max_context // self.block_size), self.device)
        self._logits = torch.zeros(max_num_seqs, config.vocab_size, dtype=torch.float32, device=self.device)
        self._graphs: DecodeGraphs | None = None
        if use_graphs:
            self._graphs = DecodeGraphs(
                self._forward_decode, self._buffers, self._context_bounds, self.block_size, self._decode_plan_key
            )
            with torch.inference_mode():
                self._graphs.capture()

    def _decode_plan_key(self, rows: int, bound: int) -> tuple:
        """The paged decode kernel's launch plans at ``rows`` rows and context bound ``bound``,
        one per distinct sliding window; a one-partition plan's length is dropped (any length
        covering the context computes the same)."""
        from conveyor.kernels.paged_decode import plan_decode_partitions

        config = self.model_config
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        windows = sorted({layer.self_attn.sliding_window or 0 for layer in self.model.layers})
        plans = []
        for window in windows:
            plan = plan_decode_partitions(
                batch=rows,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                dtype=self.dtype,
                max_context=min(bound, window) if window else bound,
                num_sms=num_sms,
            )
            plans.append(plan if plan.num_partitions > 1 else dataclasses.replace(plan, partition_size=0))
        return tuple(plans)

    def _drop(self, slots: list[int]) -> None:
        """Forget the requests on ``slots`` (a plan's ``finished_slots``). A free slot is fine:
        its request may never have been taken in (its plan failed unrun). A slot outside the
        range a scheduler hands out is refused, dropping nothing."""
        bad = [slot for slot in slots if not 0 <= slot < MAX_SLOTS]
        if bad:
            raise PlanRefused(f"finished slots {bad} outside 0..{MAX_SLOTS - 1}")
        table = self._states
        for slot in slots:
            if slot < len(table):
                table[slot] = None

    def _validate(self, plan: StepPlan) -> list[_Work]:
        """The plan's work in order (new requests first), or PlanRefused naming the first problem
        (the slot, and the request id where known).

        Runs after ``finished_slots`` are dropped (so a new request may take a slot this plan
        frees, and a cached row may not name one); mutates nothing.
        """
        table = self._states
        size = len(table)
        seen: dict[int, str] = {}  # slot -> request id, of the rows so far
        work: list[_Work] = []

        def twice(slot: int, rid: str) -> PlanRefused:
            return PlanRefused(
                f"slot {slot} appears twice in step {plan.step_id} (request {seen[slot]!r}, then {rid!r})"
            )

        for new in plan.new_requests:
            rid, slot = new.request_id, new.slot
            if not 0 <= slot < MAX_SLOTS:
                raise PlanRefused(f"new request {rid!r}: slot {slot} outside 0..{MAX_SLOTS - 1}")
            if slot in seen:
                raise twice(slot, rid)
            seen[slot] = rid
            holder = table[slot] if slot < size else None
            if holder is not None:
                raise PlanRefused(
                    f"new request {rid!r} on slot {slot}, which request {holder.request_id!r} still holds on the worker"
                )
            self._check_blocks(rid, slot, new.block_ids)
            self._check_tokens(
                rid, slot, new.num_computed_tokens, new.num_scheduled_tokens, len(new.token_ids), len(new.block_ids)
            )
            work.append(_Work(slot, new.num_computed_tokens, new.num_scheduled_tokens, []))
        cached = plan.cached_requests
        new_blocks = dict(zip(cached.new_block_rows, cached.new_block_ids))
        for row, (slot, num_computed, num_scheduled) in enumerate(
            zip(int_list(cached.slots), int_list(cached.num_computed_tokens), int_list(cached.num_scheduled_tokens))
        ):
            state = table[slot] if 0 <= slot < size else None
            if slot in seen:
                raise twice(slot, state.request_id if state is not None else "?")
            if state is None:
                raise PlanRefused(f"unknown slot {slot} (row {row}): no request on it is running on the worker")
            rid = state.request_id
            seen[slot] = rid
            if num_computed != state.num_computed:
                raise PlanRefused(
                    f"request {rid!r} (slot {slot}): num_computed_tokens mismatch: plan says {num_computed}, "
                    f"worker has {state.num_computed}"
                )
            blocks = new_blocks.get(row, [])
            if blocks:
                self._check_blocks(rid, slot, blocks)
            self._check_tokens(
                rid, slot, num_computed, num_scheduled, state.num_known, len(state.block_ids) + len(blocks)
            )
            work.append(_Work(slot, num_computed, num_scheduled, list(blocks)))
        if len(work) > self.max_num_seqs:
            raise PlanRefused(f"step {plan.step_id} runs {len(work)} requests; this runner takes at most {self.max_num_seqs}")
        self._check_transfers(plan)
        return work

    def _check_transfers(self, plan: StepPlan) -> None:
        for name, pairs, src_limit, dst_limit in (
            ("swap_out", plan.swap_out, self.num_blocks, self.num_cpu_blocks),
            ("swap_in", plan.swap_in, self.num_cpu_blocks, self.num_blocks),
        ):
            for pair in pairs:
                if len(pair) != 2 or not (0 <= pair[0] < src_limit and 0 <= pair[1] < dst_limit):
                    raise PlanRefused(f"{name} pair {pair} outside the caches ({src_limit} -> {dst_limit} blocks)")
            if len({pair[1] for pair in pairs}) != len(pairs):
                raise PlanRefused(f"{name} writes a block twice")

    def _check_tokens(
        self, rid: str, slot: int, num_computed: int, num_scheduled: int, num_tokens: int, num_blocks: int
    ) -> None:
        if num_scheduled < 1 or num_computed < 0:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): invalid counts computed={num_computed} scheduled={num_scheduled}"
            )
        end = num_computed + num_scheduled
        if end > num_tokens:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): schedules up to token {end} but only {num_tokens} tokens are known"
            )
        if num_blocks * self.block_size < end:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): block table too short: "
                f"{num_blocks} blocks of {self.block_size} tokens for {end} tokens"
            )

    def _check_blocks(self, rid: str, slot: int, block_ids: list[int]) -> None:
        """Only ids new to the runner are checked: the rest were checked when they arrived."""
        bad = [block for block in block_ids if not 0 <= block < self.num_blocks]
        if bad:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): block ids {bad} outside the pool of {self.num_blocks} blocks"
            )
