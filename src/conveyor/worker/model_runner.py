"""The model runner: the scheduler's :class:`StepPlan` becomes one forward on the device, in
two calls (:meth:`ModelRunner.launch`, :meth:`ModelRunner.finish`) so that the next step can
be queued before this one's tokens are read.

It holds the model, its KV cache and what the worker remembers per slot, and the step's parts
as objects built from what each needs (decode step, ragged step, log-probabilities,
speculative verification, grammar masks, LoRA). docs/architecture.md, "The worker's step",
says how a step runs, and the rule for a failed step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from conveyor import profiling
from conveyor.ipc.messages import NewRequestData, StepPlan, StepResult, int_list
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.attention.kv_quant import KVScales, cache_dtype
from conveyor.worker.attention.triton_backend import backend_for
from conveyor.worker.batch_invariant import invariant_backend, make_batch_invariant
from conveyor.worker.block_transfer import copy_blocks, transfer_blocks
from conveyor.worker.decode_step import DecodeStep
from conveyor.worker.draft_model import DraftModel, Drafts
from conveyor.worker.grammar_steps import GrammarSteps
from conveyor.worker.kv_cache import KVCacheShape, KVCacheTooSmall
from conveyor.worker.kv_calibration import calibrate_kv_scales
from conveyor.worker.last_tokens import LastTokens
from conveyor.worker.loader import load_model
from conveyor.worker.logprob_steps import LogprobSteps
from conveyor.worker.lora import LoraManager, LoraOptions
from conveyor.worker.lora_updates import LoraUpdates
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel
from conveyor.worker.plan_check import PlanChecker, PlanRefused
from conveyor.worker.pooling import Pooler, result_fields
from conveyor.worker.ragged_inputs import ragged_inputs
from conveyor.worker.ragged_step import RaggedStep
from conveyor.worker.request_state import SlotStates, Work
from conveyor.worker.sampler import Sampler, SamplingColumns
from conveyor.worker.sampling_controls import SamplingControls
from conveyor.worker.speculative_verify import SpeculativeVerify
from conveyor.worker.step_parts import StepParts, StepTimers
from conveyor.worker.step_state import LaunchedStep, StepOutput, StepRows


class ModelRunner:
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
        self.device = device = torch.device(config.device)
        self.block_size = config.block_size
        self.tensor_parallel = tp = tensor_parallel
        if config.batch_invariant:
            backend = invariant_backend(device, config.attention, config.lora_enabled, tp.size)
        else:
            backend = backend_for(device, config.attention)
        # (batch-invariant mode checks float kernels: there --quantization auto means float weights)
        quantization = "none" if config.batch_invariant and config.quantization == "auto" else config.quantization
        self.model, self.model_config = load_model(config.model_dir, device, config.dtype, backend, tp, quantization)
        if config.batch_invariant:
            make_batch_invariant(self.model)
        self.dtype = self.model.dtype
        # The KV cache's dtype (an 8-bit one's per-layer scales are measured before LoRA is on).
        self.kv_cache_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        cache_shape = KVCacheShape.of(self.model_config, config.block_size, self.kv_cache_dtype, tp)
        kv_scales = calibrate_kv_scales(self.model, cache_shape, self.kv_cache_dtype)
        self.lora: LoraManager | None = None
        if config.lora_enabled:
            self.lora = LoraManager(
                self.model, LoraOptions(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            )
            for name, directory in config.lora_modules:
                self.lora.register(name, directory)
        self.draft: DraftModel | None = None
        if config.speculative_model is not None:  # (this rank's shard of it, as of the model)
            draft_backend = backend_for(device, config.attention)  # its own (a backend may keep per-step plans)
            self.draft = DraftModel(
                config.speculative_model,
                self.model_config,
                device,
                self.dtype,
                draft_backend,
                config.block_size,
                tp,
                kv_cache_dtype=config.kv_cache_dtype,
            )
        self._allocate_caches(config, cache_shape, kv_scales)
        self.adapters = LoraUpdates(self.lora, tp, device)
        self.parts = parts = self._step_parts(config, profiler)
        self.decode = DecodeStep(
            parts, max_num_seqs=config.max_num_seqs, num_blocks=self.num_blocks, enforce_eager=config.enforce_eager,
            pad_decode=config.pad_decode, backend=backend, verify_width=config.num_speculative_tokens,
        )  # fmt: skip
        self.ragged = RaggedStep(parts)
        self._checker = PlanChecker(config.block_size, self.num_blocks, self.num_cpu_blocks, config.max_num_seqs)
        self._last: LaunchedStep | None = None  # the step launched last (did it fail?)
        self._cuda = device.type == "cuda"
        # Host buffers the sampled ids land in, two so that a step can be launched while the
        # previous one's are still unread (pinned on CUDA, so the copy does not block).
        self._sampled_host: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64) for _ in range(2)]
        self._next_buffer = 0

    def _allocate_caches(
        self, config: RunnerConfig, cache_shape: KVCacheShape, kv_scales: list[KVScales] | None
    ) -> None:
        """The KV pool (``num_blocks``, or as many as ``kv_cache_memory_bytes`` holds, blocks of
        ``cache_shape``; an 8-bit one read by ``kv_scales``) and the CPU swap space, the
        model's and the draft's, a block of the pool holding both."""
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
        self.model.bind_kv_cache(self.kv_caches, kv_scales)
        num_cpu_blocks = config.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = (config.swap_space_bytes or 0) // self.block_bytes
        self.num_cpu_blocks = num_cpu_blocks
        self.swap_caches = cache_shape.allocate_swap(num_cpu_blocks, self.device)
        # (cache, swap space) pairs every block move of a plan applies to: the model's, the draft's
        self.cache_sets = [(self.kv_caches, self.swap_caches)]
        if self.draft is not None:
            self.draft.allocate(num_blocks, num_cpu_blocks)
            self.cache_sets.append((self.draft.kv_caches, self.draft.swap_caches))

    def _step_parts(self, config: RunnerConfig, profiler: profiling.Profiler | None) -> StepParts:
        """The per-slot state and the parts a step runs through, each built from what it uses."""
        device, tp, model = self.device, self.tensor_parallel, self.model
        requests = SlotStates()  # request state and block tables by slot
        sampling = SamplingColumns()  # per-slot sampling parameters, set when a request arrives
        last_tokens = LastTokens(device)
        sampler = Sampler(device, invariant=config.batch_invariant)
        return StepParts(
            model=model,
            device=device,
            block_size=config.block_size,
            requests=requests,
            last_tokens=last_tokens,
            sampler=sampler,
            sampling=sampling,
            # Per-slot device state of the requests using penalties, logit_bias or min_tokens.
            controls=SamplingControls(self.model_config.vocab_size, device, self.model_config.eos_token_ids),
            grammar=GrammarSteps(config.model_dir, requests, tp, device),
            logprobs=LogprobSteps(model, requests, sampling, device, config.batch_invariant),
            verifier=SpeculativeVerify(sampler, sampling, last_tokens, tp, device),
            adapters=self.adapters,
            pooler=Pooler(),
            tensor_parallel=tp,
            timers=StepTimers.of(profiler),
        )

    @property
    def slots(self) -> list[int]:
        """The slots whose request state the runner holds, in increasing order."""
        return self.parts.requests.slots

    @property
    def request_ids(self) -> list[str]:
        """The ids of the requests whose state the runner holds, in slot order."""
        return self.parts.requests.request_ids

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
        self._drop_finished(plan)
        if plan.planned_ahead and before is not None and before.failed:
            raise PlanRefused(f"step {plan.step_id} was planned ahead of step {plan.step_id - 1}, which failed")
        work = self._checker.check(plan, self.parts.requests.states, self.draft is not None)
        adapters = [self.adapters.adapter_id(new.lora) for new in plan.new_requests]
        self._move_blocks(plan)
        self._take_in(plan.new_requests, adapters)
        launched.start = time.perf_counter()
        rows = self._rows(work, before)
        drafts = self._run_draft(rows) if self.draft is not None and work else None
        out = self._forward(rows, drafts) if work else None
        for item, state in zip(work, rows.states):
            state.num_computed += item.num_scheduled
        self._hand_over(launched, rows, out, drafts)
        if plan.planned_ahead:
            launched.before = before  # (its finish may still fail this one: see finish)
        launched.failed = False
        return launched

    def _drop_finished(self, plan: StepPlan) -> None:
        """Forget the plan's finished slots: the first thing a plan does, refused or not."""
        dropped = int_list(plan.finished_slots)
        PlanChecker.check_dropped(dropped)
        self.parts.requests.drop(dropped)
        self.parts.controls.release(dropped)
        self.parts.pooler.forget(dropped)

    def _move_blocks(self, plan: StepPlan) -> None:
        """Copies out, copies in, then the forks' block copies, all before the forward (see
        StepPlan): a GPU block swapped out may be given again by this same plan (as a swap-in
        or copy destination, or for new KV), so it is read first; a copy's source may be a
        block this plan swaps in (its first sequence resumed), so it is read after."""
        if plan.swap_out or plan.swap_in:
            swap_start = profiling.now_ns()
            for caches, swap in self.cache_sets:
                transfer_blocks(caches, swap, plan.swap_out)
                transfer_blocks(swap, caches, plan.swap_in)
            self.parts.timers.swap.record(swap_start, arg=len(plan.swap_out) + len(plan.swap_in))
        if plan.copy_blocks:
            pairs = torch.tensor(plan.copy_blocks, dtype=torch.int64)
            for caches, _ in self.cache_sets:
                copy_blocks(caches, pairs)

    def _take_in(self, new_requests: list[NewRequestData], adapters: list[int]) -> None:
        """Hold the plan's new requests on their slots (free: checked, the finished ones
        dropped), with their sampling parameters, controls and grammars."""
        parts = self.parts
        for new, adapter in zip(new_requests, adapters):
            parts.requests.take_in(new, adapter)
            parts.pooler.take_in(new.slot, new.sampling.pooling)
            parts.sampling.set(new.slot, new.sampling)
            num_prompt = len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
            if self.tensor_parallel.rank == 0:  # (the rank that samples holds the controls' state)
                parts.controls.assign(new.slot, new.sampling, parts.requests.states[new.slot].token_ids, num_prompt)
            parts.grammar.take_in(new.slot, new.sampling.grammar, num_prompt)
        parts.last_tokens.cover(len(parts.requests))

    def _rows(self, work: list[Work], before: LaunchedStep | None) -> StepRows:
        """The step's rows, their new blocks in their tables; a row samples when the step
        computes its last known token (its proposal's too)."""
        requests = self.parts.requests
        states = [requests.states[item.slot] for item in work]
        for item, state in zip(work, states):
            if item.new_block_ids:
                requests.extend_blocks(item.slot, state, item.new_block_ids)
        samples = self.parts.pooler.sampling_rows(
            work,
            [  # (a pooling row samples nothing: it is pooled)
                item.num_computed + item.num_scheduled == state.num_known + item.num_proposed
                for item, state in zip(work, states)
            ],
        )
        return StepRows(work, states, samples, before)

    def _run_draft(self, rows: StepRows) -> Drafts | None:
        """The draft model's share of the step (:mod:`conveyor.worker.draft_model`): every row's
        tokens (a drafting row's last known one only), then the drafted tokens, on the device."""
        start = profiling.now_ns()
        counts = [1 if item.num_drafted else item.num_scheduled for item in rows.work]
        tables = self.parts.requests.tables[rows.slots]
        inputs = ragged_inputs(rows.work, rows.states, counts, tables, self.block_size, self.parts.last_tokens.tokens)
        drafts = self.draft.propose(rows.work, inputs, tables)
        self.parts.timers.draft.record(start)
        return drafts

    def _forward(self, rows: StepRows, drafts: Drafts | None) -> StepOutput:
        """Forward the step and sample: a decode-only step (every row runs one token, or a
        verify of its proposal) through the static buffers, any other (or one scoring prompt
        positions or pooling, whose hidden states the decode step does not keep) the flattened ragged way."""
        scores_prompt = self.parts.logprobs.scores_prompt(rows.work, rows.states) or self.parts.pooler.in_step(
            rows.work
        )
        q = None if scores_prompt else self.decode.static_query_len(rows.work)
        if q is not None:
            return self.decode.run(rows, q)
        return self.ragged.run(rows, drafts)

    def _hand_over(self, launched: LaunchedStep, rows: StepRows, out: StepOutput | None, drafts: Drafts | None) -> None:
        """What the finish reads, queued to the host behind the step: the sampling rows and
        their ids (also the next steps' inputs, on the device), the speculative verdict and
        the log-probabilities; the event the finish waits for."""
        sampling = [(item.slot, state) for item, state, flag in zip(rows.work, rows.states, rows.samples) if flag]
        launched.slots = [slot for slot, _ in sampling]
        launched.states = [state for _, state in sampling]
        launched.ends = out.ends if out is not None else []
        self._hand_over_verdict(launched, rows, out.verdict if out is not None else None, drafts)
        if sampling:
            for _, state in sampling:
                state.pending += 1
            self.parts.last_tokens.scatter(out.sample_slots, out.sampled)  # (without a host round trip)
            launched.sampled = self._copy_to_host(out.sampled)
        if out is not None:
            for logprob_rows in (out.logprobs, out.prompt_logprobs, out.pooled):
                if logprob_rows is not None:
                    logprob_rows.to_host(self._cuda)
            launched.logprobs, launched.prompt_logprobs, launched.pooled = out.logprobs, out.prompt_logprobs, out.pooled
        if (sampling or launched.prompt_logprobs is not None or launched.pooled is not None) and self._cuda:
            launched.done = torch.cuda.Event()
            launched.done.record()

    def _hand_over_verdict(
        self, launched: LaunchedStep, rows: StepRows, verdict: torch.Tensor | None, drafts: Drafts | None
    ) -> None:
        """The speculative rows (their indices among the sampling rows), their proposals and
        the verdict on them, the same on every rank (rank 0 verified them)."""
        proposed = sum(item.num_proposed for item in rows.work)
        if proposed:
            verdict = self.parts.verifier.shared_verdict(verdict, proposed)
        if verdict is None:
            return
        sampled_items = [item for item, flag in zip(rows.work, rows.samples) if flag]
        launched.spec_rows = [i for i, item in enumerate(sampled_items) if item.num_proposed]
        launched.spec_proposals = [sampled_items[i].proposal for i in launched.spec_rows]
        launched.spec_verdict = self._host_copy(verdict)
        if drafts is not None:  # (its logits are [proposed, vocab]: not held past the launch)
            launched.drafted, launched.drafted_counts = self._host_copy(drafts.tokens), drafts.counts

    def _host_copy(self, values: torch.Tensor) -> torch.Tensor:
        """A host copy of int64 ``values`` queued behind the step (pinned on CUDA: not blocking)."""
        host = torch.empty(values.shape, dtype=torch.int64, pin_memory=self._cuda)
        return host.copy_(values, non_blocking=self._cuda)

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
        spec_slots, spec_runs = [], []
        if launched.spec_rows:
            spec_slots, spec_runs = self.parts.verifier.accept(
                launched.spec_verdict.tolist(), launched.spec_rows, launched.spec_proposals, launched.slots,
                launched.states, tokens,
            )  # fmt: skip
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
