"""What a step's forward is built from, shared by the decode step and the ragged step: the
model (through :class:`~conveyor.worker.models.interface.CausalLM` only), the per-slot state,
the sampling side and the runner's other parts, each an object the runner holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor import profiling
from conveyor.worker.grammar_steps import GrammarSteps
from conveyor.worker.last_tokens import LastTokens
from conveyor.worker.logprob_steps import LogprobSteps
from conveyor.worker.lora_updates import LoraUpdates
from conveyor.worker.models.interface import CausalLM
from conveyor.worker.parallel import TensorParallel
from conveyor.worker.pooling import Pooler
from conveyor.worker.request_state import SlotStates
from conveyor.worker.sampler import Sampler, SamplingColumns
from conveyor.worker.sampling_controls import SamplingControls
from conveyor.worker.speculative_verify import SpeculativeVerify


@dataclass(frozen=True, eq=False)
class StepTimers:
    """Stage timers of a step's launch. On CUDA kernels run asynchronously: these are then
    host (launch) times, and the device's time shows in the worker's ``wait_tokens``."""

    prepare: profiling.Timer
    forward: profiling.Timer
    sample: profiling.Timer  # the LM head on the sampled rows + the sampler
    swap: profiling.Timer  # only steps that copy blocks
    draft: profiling.Timer  # the draft model's pass and proposals (draft method)

    @classmethod
    def of(cls, profiler: profiling.Profiler | None) -> StepTimers:
        prof = profiler or profiling.Profiler("worker", enabled=False)
        return cls(
            prof.timer("prepare_inputs"),
            prof.timer("forward"),
            prof.timer("sample"),
            prof.timer("swap", arg_name="blocks"),
            prof.timer("draft"),
        )


@dataclass(frozen=True, eq=False)
class StepParts:
    """The objects a forward step reads and writes. ``requests``: request state and block
    tables by slot; ``sampling`` and ``controls``: per-slot sampling parameters and the
    device state of penalties, logit bias and ``min_tokens``; only rank 0 of
    ``tensor_parallel`` computes logits and samples."""

    model: CausalLM
    device: torch.device
    block_size: int
    requests: SlotStates
    last_tokens: LastTokens
    sampler: Sampler
    sampling: SamplingColumns
    controls: SamplingControls
    grammar: GrammarSteps
    logprobs: LogprobSteps
    verifier: SpeculativeVerify
    adapters: LoraUpdates
    pooler: Pooler  # the pooling requests' slots and running sums (conveyor.worker.pooling)
    tensor_parallel: TensorParallel
    timers: StepTimers
