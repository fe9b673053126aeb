"""Executes the scheduler's :class:`StepPlan` on the device: one flattened forward per step.

The runner keeps what the worker must remember between steps, per request, by slot: every
known token (the prompt, then what it sampled), the block table and the sampling parameters
(:mod:`~conveyor.worker.request_state`). The scheduler stays the authority on blocks, slots
and how many tokens run; the runner checks that each plan is consistent with what it holds
and refuses one that is not, before it changes any state, apart from dropping the plan's
finished slots, which comes first (:mod:`~conveyor.worker.plan_check`).

**A failed step.** A plan planned ahead of step N assumes N succeeds. If N fails, at its
launch or at its finish, the runner fails the plan after it too, and this is the one place
that rule is kept: launched after N failed, that plan is refused unrun (only its finished
slots dropped); launched before N failed at its finish, its result is an error.

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

**The decode step** (every row runs one token, or its last token and a speculative proposal
of up to ``num_speculative_tokens``: a verify step) runs through static buffers and CUDA
graphs (:mod:`conveyor.worker.decode_step`). Prefill, chunked prefill and mixed steps run
the flattened ragged batch here.
Sampling is batched over per-row parameter tensors (:mod:`conveyor.worker.sampler`).
Pooling (embedding requests) is :mod:`conveyor.worker.pooling`'s. The runner's other parts are
base classes of it, each in its own module: log-probability gathering (:mod:`conveyor.worker.logprob_steps`), the verification (rejection
sampling) of speculative rows (:mod:`conveyor.worker.speculative_verify`) and the grammar-constraint
plumbing (:mod:`conveyor.worker.grammar_steps`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from conveyor import profiling
from conveyor.ipc.messages import StepPlan, StepResult, int_list
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.attention.triton_backend import backend_for
from conveyor.worker.batch_invariant import invariant_backend, make_batch_invariant
from conveyor.worker.block_transfer import copy_blocks, transfer_blocks
from conveyor.worker.decode_step import DecodeStep
from conveyor.worker.draft_model import DraftModel, Drafts
from conveyor.worker.grammar_rows import GrammarRows
from conveyor.worker.grammar_steps import GrammarSteps
from conveyor.worker.kv_cache import KVCacheShape, KVCacheTooSmall
from conveyor.worker.loader import load_model
from conveyor.worker.logprob_steps import LogprobRows, LogprobSteps
from conveyor.worker.lora import LoraManager, LoraOptions
from conveyor.worker.lora_updates import LoraUpdates
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel, broadcast_from_first_
from conveyor.worker.plan_check import PlanChecker, PlanRefused
from conveyor.worker.pooling import PooledRows, Pooler, result_fields
from conveyor.worker.ragged_inputs import ragged_inputs
from conveyor.worker.request_state import RequestState, SlotStates, Work
from conveyor.worker.sampler import Sampler, SamplingColumns, batch_from_rows
from conveyor.worker.sampling_controls import SamplingControls
from conveyor.worker.speculative_verify import SpeculativeVerify


@dataclass(eq=False)
class LaunchedStep:
    """A step enqueued on the device, waiting for :meth:`ModelRunner.finish`.

    ``failed``: the step failed (its launch, its finish, or the step before it); ``before``:
    the step launched just before it, while that one is unfinished (the failure rule reads
    it at the finish; the link is cut when a step finishes, so at most two are chained)."""

    step_id: int
    planned_ahead: bool
    slots: list[int]  # the slots that sample, in result order
    states: list[RequestState]  # their states (held here: a later plan may drop the slots)
    sampled: torch.Tensor | None = None  # host buffer the sampled ids are copied into
    done: torch.cuda.Event | None = None  # recorded after that copy (CUDA only)
    start: float = 0.0  # perf_counter at launch
    logprobs: LogprobRows | None = None  # of the sampled tokens, for the rows that asked
    prompt_logprobs: LogprobRows | None = None  # of the prompt positions computed, likewise
    failed: bool = True  # until launched
    before: LaunchedStep | None = None
    ends: list[tuple[int, str]] | None = None  # constrained rows the grammar ended: (slot, error)
    # Speculative rows: their indices among ``slots``, their proposals, and the verdict at
    # each proposed position, flat ([2, R]: accepted, residual draw; copied to the host like
    # ``sampled``; conveyor.worker.speculative_verify).
    spec_rows: list[int] | None = None
    spec_proposals: list[tuple[int, ...]] | None = None
    spec_verdict: torch.Tensor | None = None
    # Drafted proposals (the draft method): their tokens, copied to the host like
    # ``spec_verdict``, and each speculative row's count; split into ``spec_proposals`` at the finish.
    drafted: torch.Tensor | None = None
    drafted_counts: list[int] | None = None
    pooled: PooledRows | None = None  # the pooling requests' vectors (conveyor.worker.pooling)


class ModelRunner(DecodeStep, LogprobSteps, SpeculativeVerify, GrammarSteps, LoraUpdates):
    """The model, its KV cache, the sampler and per-request state of one worker, as ``config``
    (:class:`~conveyor.runtime.config.RunnerConfig`, which says what each field does) describes
    them; ``config.device`` is a concrete device (:func:`conveyor.worker.main.build_runner`
    resolves ``auto`` and a rank's GPU). ``attention`` picks the backend: ``auto`` (Triton on
    CUDA, torch on CPU), ``triton`` or ``torch``. On CUDA the decode step is captured as CUDA
    graphs unless ``enforce_eager``; a step with a proposal longer than
    ``num_speculative_tokens`` runs ragged.

    LoRA (:mod:`conveyor.worker.lora`): ``lora_modules`` are registered at once (a bad one
    raises :class:`~conveyor.worker.lora.LoraLoadError`). Requests name their adapter in
    :class:`~conveyor.ipc.messages.NewRequestData`.

    ``speculative_model``: the draft checkpoint of speculative decoding's draft method
    (:mod:`conveyor.worker.draft_model`), loaded beside the model; the pool's blocks then hold
    both models' KV (``block_bytes`` is the sum).

    ``tensor_parallel``: this runner is one rank of a tensor-parallel group
    (:mod:`conveyor.worker.parallel`). It holds the rank's shard of the model and a cache of
    its kv heads (``kv_cache_memory_bytes`` is then this rank's budget); only rank 0 computes
    logits and samples, and broadcasts the ids (and a speculative step's targets), so every
    rank returns the same results and keeps the same request state. Every rank must be given the same plans.
    ``profiler``: the worker process's, timing the step's parts.
    """

    def __init__(
        self,
        config: RunnerConfig,
        *,
        profiler: profiling.Profiler | None = None,
        tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> None:
        if (config.num_blocks is None) == (config.kv_cache_memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_cache_memory_bytes")
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = block_size = config.block_size
        self.tensor_parallel = tp = tensor_parallel
        backend = invariant_backend(self.device, config.attention, config.lora_enabled) if config.batch_invariant else backend_for(self.device, config.attention)
        self.model, self.model_config = load_model(config.model_dir, self.device, config.dtype, backend, tp)
        if config.batch_invariant:
            make_batch_invariant(self.model)
        self.dtype = self.model.dtype
        self.lora: LoraManager | None = None
        if config.lora_enabled:
            self.lora = LoraManager(self.model, LoraOptions(config.max_loras, config.max_lora_rank, config.max_cpu_loras))
            for name, directory in config.lora_modules:
                self.lora.register(name, directory)
        cache_shape = KVCacheShape.of(self.model_config, block_size, self.dtype, tp)
        self.draft: DraftModel | None = None
        if config.speculative_model is not None:  # (this rank's shard of it, as of the model)
            draft_backend = backend_for(self.device, config.attention)  # its own (a backend may keep per-step plans)
            self.draft = DraftModel(
                config.speculative_model, self.model_config, self.device, self.dtype, draft_backend, block_size, tp
            )
        self.block_bytes = cache_shape.bytes_per_block + (self.draft.bytes_per_block if self.draft else 0)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = config.kv_cache_memory_bytes // self.block_bytes
            if num_blocks < 1:
                raise KVCacheTooSmall(
                    f"kv_cache_memory of {config.kv_cache_memory_bytes / 2**30:.3g} GiB is less than one KV block "
                    f"({self.block_bytes} bytes): give more, or num_kv_blocks"
                )
        self.num_blocks = num_blocks
        self.kv_caches = cache_shape.allocate(num_blocks, self.device)
        self.model.bind_kv_cache(self.kv_caches)
        num_cpu_blocks = config.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = (config.swap_space_bytes or 0) // self.block_bytes
        self.num_cpu_blocks = num_cpu_blocks
        self.swap_caches = cache_shape.allocate_swap(num_cpu_blocks, self.device)
        # (cache, swap space) pairs every block move of a plan applies to: the model's, the draft's
        self._cache_sets = [(self.kv_caches, self.swap_caches)]
        if self.draft is not None:
            self.draft.allocate(num_blocks, num_cpu_blocks)
            self._cache_sets.append((self.draft.kv_caches, self.draft.swap_caches))
        self.sampler = Sampler(self.device)
        self._sampling = SamplingColumns()  # per-slot sampling parameters, set when a request arrives
        # Per-slot device state of the requests using penalties, logit_bias or min_tokens.
        self._controls = SamplingControls(self.model_config.vocab_size, self.device, self.model_config.eos_token_ids)
        self._requests = SlotStates()  # request state and block tables by slot
        # The last token of each slot, on the device: grows with the slot table.
        self._last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._last: LaunchedStep | None = None  # the step launched last (did it fail?)
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
        self._t_draft = prof.timer("draft")  # the draft model's pass and proposals (draft method)
        self._setup_decode_step(
            config.max_num_seqs, config.enforce_eager, config.pad_decode, backend, config.num_speculative_tokens
        )
        # Structured output (conveyor.worker.grammar_rows): matchers of constrained requests,
        # and a per-slot flag so that a step without them is told apart in one numpy test.
        self._grammars = GrammarRows(config.model_dir)
        self._constrained = np.zeros(0, np.bool_)
        self._in_flight: LaunchedStep | None = None  # the unfinished step a launch may read tokens of
        self._ends: list[tuple[int, str]] = []
        self._spec_verdict: torch.Tensor | None = None  # of the step being launched (see _run_ragged)
        self._drafts: Drafts | None = None  # likewise, the draft method's proposals (dropped after the launch)
        self._pooler, self._pooled = Pooler(), None  # pooling (and the pooled rows of the step being launched)
        self._checker = PlanChecker(block_size, num_blocks, num_cpu_blocks, config.max_num_seqs)

    @property
    def slots(self) -> list[int]:
        """The slots whose request state the runner holds, in increasing order."""
        return self._requests.slots

    @property
    def request_ids(self) -> list[str]:
        """The ids of the requests whose state the runner holds, in slot order."""
        return self._requests.request_ids

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
        before = self._last
        launched = self._last = LaunchedStep(plan.step_id, plan.planned_ahead, [], [])  # failed until launched
        requests = self._requests
        dropped = int_list(plan.finished_slots)
        PlanChecker.check_dropped(dropped)
        requests.drop(dropped)
        self._controls.release(dropped)
        self._pooler.forget(dropped)
        if plan.planned_ahead and before is not None and before.failed:
            raise PlanRefused(f"step {plan.step_id} was planned ahead of step {plan.step_id - 1}, which failed")
        work = self._checker.check(plan, requests.states, self.draft is not None)
        adapters = [self._adapter_id(new.lora) for new in plan.new_requests]
        # Copies out, copies in, then the forks' block copies, all before the forward (see
        # StepPlan): a GPU block swapped out may be given again by this same plan (as a swap-in
        # or copy destination, or for new KV), so it is read first; a copy's source may be a
        # block this plan swaps in (its first sequence resumed), so it is read after.
        if plan.swap_out or plan.swap_in:
            swap_start = profiling.now_ns()
            for caches, swap in self._cache_sets:
                transfer_blocks(caches, swap, plan.swap_out)
                transfer_blocks(swap, caches, plan.swap_in)
            self._t_swap.record(swap_start, arg=len(plan.swap_out) + len(plan.swap_in))
        if plan.copy_blocks:
            pairs = torch.tensor(plan.copy_blocks, dtype=torch.int64)
            for caches, _ in self._cache_sets:
                copy_blocks(caches, pairs)
        for new, adapter in zip(plan.new_requests, adapters):  # on free slots (checked), the finished ones dropped above
            requests.take_in(new, adapter)
            self._pooler.take_in(new.slot, new.sampling.pooling)
            self._sampling.set(new.slot, new.sampling)
            num_prompt = len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
            if self.tensor_parallel.rank == 0:  # (the rank that samples holds the controls' state)
                self._controls.assign(new.slot, new.sampling, requests.states[new.slot].token_ids, num_prompt)
            self._take_in_grammar(new.slot, new.sampling.grammar, num_prompt)
        table = requests.states
        if len(self._last_tokens) < len(table):
            grown = torch.zeros(len(table), dtype=torch.int64, device=self.device)
            grown[: len(self._last_tokens)] = self._last_tokens
            self._last_tokens = grown
        start = time.perf_counter()
        states = [table[item.slot] for item in work]
        for item, state in zip(work, states):
            if item.new_block_ids:
                requests.extend_blocks(item.slot, state, item.new_block_ids)
        samples = self._pooler.sampling_rows(work, [
            item.num_computed + item.num_scheduled == state.num_known + item.num_proposed
            for item, state in zip(work, states)
        ])
        self._in_flight, self._ends, self._spec_verdict, self._pooled = before, [], None, None
        self._drafts = self._run_draft(work, states) if self.draft is not None and work else None
        sampled, sample_slots, logprobs, prompt_logprobs = self._run(work, states, samples) if work else (None,) * 4
        launched.ends, launched.pooled, self._in_flight, self._pooled = self._ends, self._pooled, None, None
        for item, state in zip(work, states):
            state.num_computed += item.num_scheduled
        sampling = [(item.slot, state) for item, state, flag in zip(work, states, samples) if flag]
        launched.slots = [slot for slot, _ in sampling]
        launched.states = [state for _, state in sampling]
        proposed = sum(item.num_proposed for item in work)
        if proposed:  # (rank 0 verified them; every rank accepts the same tokens)
            self._spec_verdict = self._shared_verdict(self._spec_verdict, proposed)
        if self._spec_verdict is not None:
            sampled_items = [item for item, flag in zip(work, samples) if flag]
            launched.spec_rows = [i for i, item in enumerate(sampled_items) if item.num_proposed]
            launched.spec_proposals = [sampled_items[i].proposal for i in launched.spec_rows]
            launched.spec_verdict = self._host_copy(self._spec_verdict)
            if self._drafts is not None:
                launched.drafted, launched.drafted_counts = self._host_copy(self._drafts.tokens), self._drafts.counts
        self._drafts = None  # (its logits are [proposed, vocab]: not held past the launch)
        launched.start = start
        if plan.planned_ahead:
            launched.before = before  # (its finish may still fail this one: see finish)
        if sampling:
            for _, state in sampling:
                state.pending += 1
            # the next steps' inputs, without a host round trip
            self._last_tokens.index_copy_(0, sample_slots, sampled)
            launched.sampled = self._copy_to_host(sampled)
        for rows in (logprobs, prompt_logprobs, launched.pooled):
            if rows is not None:
                rows.to_host(self._cuda)
        launched.logprobs, launched.prompt_logprobs = logprobs, prompt_logprobs
        if sampling or prompt_logprobs is not None or launched.pooled is not None:
            if self._cuda:
                launched.done = torch.cuda.Event()
                launched.done.record()
        launched.failed = False
        return launched

    def _adapter_id(self, name: str | None) -> int:
        """The id of a new request's adapter; PlanRefused (before any state changes) for one
        the runner does not hold (a race with an unload, or LoRA off)."""
        if not name:
            return 0
        if self.lora is None or name not in self.lora.names:
            raise PlanRefused(f"unknown LoRA adapter {name!r}")
        return self.lora.adapter_id(name)

    def _begin_lora(self, states: list[RequestState], row_tokens: np.ndarray) -> bool:
        """Set the step's adapter batch (rows in ``states`` order, ``row_tokens`` tokens each,
        padding rows past ``states`` run the base model); whether any row has an adapter."""
        if self.lora is None:
            return False
        adapters = np.zeros(len(row_tokens), dtype=np.int64)
        adapters[: len(states)] = [state.adapter for state in states]
        return self.lora.begin_step(adapters, row_tokens)

    def _host_copy(self, values: torch.Tensor) -> torch.Tensor:
        """A host copy of int64 ``values`` queued behind the step (pinned on CUDA: not blocking)."""
        host = torch.empty(values.shape, dtype=torch.int64, pin_memory=self._cuda)
        return host.copy_(values, non_blocking=self._cuda)

    def _run_draft(self, work: list[Work], states: list[RequestState]) -> Drafts | None:
        """The draft model's share of the step (:mod:`conveyor.worker.draft_model`): every row's
        tokens (a drafting row's last known one only), then the drafted tokens, on the device."""
        start = profiling.now_ns()
        counts = [1 if item.num_drafted else item.num_scheduled for item in work]
        tables = self._requests.tables[np.fromiter([item.slot for item in work], np.int64, len(work))]
        inputs = ragged_inputs(work, states, counts, tables, self.block_size, self._last_tokens)
        drafts = self.draft.propose(work, inputs, tables)
        self._t_draft.record(start)
        return drafts

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
        return the step's result. Launched steps are finished in launch order.

        A step planned ahead of one that failed at its finish (after this one was launched)
        fails too: its result is an error, its requests' state advanced as launched (the
        scheduler fails them, and drops their slots with its next plan)."""
        try:
            if launched.done is not None:
                launched.done.synchronize()
            tokens = launched.sampled.tolist() if launched.sampled is not None else []
        except Exception:
            launched.failed = True  # (a device error) a plan planned ahead of this step fails too
            raise
        if launched.drafted is not None:  # (the copy is done: it was queued before the sampled ids')
            flat, counts = launched.drafted.tolist(), launched.drafted_counts
            launched.spec_proposals = [tuple(flat[end - n : end]) for n, end in zip(counts, np.cumsum(counts).tolist())]
        spec_slots, spec_runs = self._accept(launched, tokens) if launched.spec_rows else ([], [])
        for state, token in zip(launched.states, tokens):
            state.token_ids.append(token)
            state.pending -= 1
        for row, run in zip(launched.spec_rows or (), spec_runs):
            launched.states[row].token_ids += run
        before, launched.before = launched.before, None
        if before is not None and before.failed:
            launched.failed = True
            return StepResult(
                launched.step_id, [], [], error=f"step {launched.step_id} was planned ahead of a step that failed"
            )
        ends = launched.ends or []
        return StepResult(
            launched.step_id,
            launched.slots,
            tokens,
            forward_time=time.perf_counter() - launched.start,
            end_slots=[slot for slot, _ in ends],
            end_errors=[error for _, error in ends],
            logprobs=launched.logprobs.message() if launched.logprobs is not None else None,
            prompt_logprobs=launched.prompt_logprobs.message() if launched.prompt_logprobs is not None else None,
            spec_slots=spec_slots,
            spec_token_ids=spec_runs,
            **result_fields(launched.pooled),
        )

    def _run(
        self, work: list[Work], states: list[RequestState], samples: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor, LogprobRows | None, LogprobRows | None]:
        """Forward the step and sample; returns, on the device, the ids sampled for the rows with
        ``samples`` set, in order, and their slots (nothing here waits for the device), then
        the log-probabilities of the sampled tokens and of the prompt positions computed, for
        the requests that asked (None when none did: nothing extra runs then). A
        decode-only step (every row runs one token, or a verify of its proposal) takes the
        static-buffer path (:meth:`_run_decode`), any other the flattened ragged one
        (:meth:`_run_ragged`)."""
        q = None if self._scores_prompt(work, states) or self._pooler.in_step(work) else self._static_query_len(work)
        if q is not None:
            return self._run_decode(work, states, samples, q)
        return self._run_ragged(work, states, samples)

    def _run_ragged(
        self, work: list[Work], states: list[RequestState], samples: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor, LogprobRows | None, LogprobRows | None]:
        """Prefill, chunked prefill, mixed and speculative steps: the new tokens laid end to end,
        unpadded (:mod:`conveyor.worker.ragged_inputs`); a drafting row's proposal is the
        draft's tokens of this step."""
        start = profiling.now_ns()
        query_lens = [item.num_scheduled for item in work]
        slots = np.fromiter([item.slot for item in work], np.int64, len(work))
        drafted = self._drafts.tokens if self._drafts is not None else None
        inputs = ragged_inputs(work, states, query_lens, self._requests.tables[slots], self.block_size, self._last_tokens, drafted)
        tokens, positions, metadata = inputs.tokens, inputs.positions, inputs.metadata
        self._begin_lora(states, np.asarray(query_lens, dtype=np.int64))
        start = self._t_prepare.record(start)
        try:
            hidden = self.model(tokens, positions, metadata)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        start = self._t_forward.record(start)

        sample_rows = np.flatnonzero(samples)
        sample_slots = torch.from_numpy(slots[sample_rows]).to(self.device, non_blocking=True)
        if self.tensor_parallel.rank == 0:
            ends = inputs.ends
            # Speculative rows also score each position before their last (the distributions
            # their proposals are verified against): in the same LM head call, after the sampled rows.
            spec_index = [
                np.arange(end - item.num_scheduled, end - 1) for item, end in zip(work, ends.tolist()) if item.num_proposed
            ]
            logit_rows = np.concatenate([ends[sample_rows] - 1, *spec_index])
            logits = self.model.compute_logits(hidden[torch.from_numpy(logit_rows).to(self.device, non_blocking=True)])
            if spec_index:
                self._spec_verdict = self._verify_proposals(logits[len(sample_rows) :], work, slots, drafted)
                logits = logits[: len(sample_rows)]
            # The position of the token being drawn is fixed for each output index of a request,
            # so it keys a seeded draw as well as the output index would, across preemptions too.
            draw_positions = np.fromiter([item.num_computed + item.num_scheduled for item in work], np.int64, len(work))
            rows_slots, rows_positions = slots[sample_rows], draw_positions[sample_rows]
            controls = self._controls.upload(self._controls.select(rows_slots, rows_positions))
            batch = batch_from_rows(
                self._sampling.gather(rows_slots), rows_positions, logits.shape[1], self.device, controls
            )
            self._constrain(batch, slots, sample_rows, states, True, len(sample_rows))
            sampled = self.sampler.sample(logits, batch)
            logprobs = self._sampled_logprobs(
                logits, np.arange(len(sample_rows)), sampled, slots[sample_rows], draw_positions[sample_rows]
            )
            prompt_logprobs = self._prompt_logprobs(hidden, work, states, offsets := ends - np.asarray(query_lens, np.int64))
            self._pooled = self._pooler.pool(hidden, work, states, offsets)
        else:  # rank 0 holds the LM head and samples; the next steps' inputs need its ids here too
            sampled = torch.empty(len(sample_rows), dtype=torch.int64, device=self.device)
            logprobs = prompt_logprobs = None
        broadcast_from_first_(sampled, self.tensor_parallel)
        self._t_sample.record(start)
        return sampled, sample_slots, logprobs, prompt_logprobs
