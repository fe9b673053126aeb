"""What one step carries between the runner and its parts: the rows it runs, what its forward
leaves on the device, and the launched step waiting for its finish (docs/architecture.md,
"The worker's step")."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.worker.logprob_steps import LogprobRows
from conveyor.worker.pooling import PooledRows
from conveyor.worker.request_state import RequestState, Work


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


@dataclass(eq=False)
class StepRows:
    """The rows a step's forward runs: each row's work and request state, whether it samples
    (it computes its last known token), and ``in_flight``, the step launched before it while
    that one is unfinished (a constrained row waits for its sampled ids there)."""

    work: list[Work]
    states: list[RequestState]
    samples: list[bool]
    in_flight: LaunchedStep | None = None
    slots: np.ndarray = field(init=False)  # int64, each row's slot
    sample_rows: np.ndarray = field(init=False)  # the indices of the rows that sample

    def __post_init__(self) -> None:
        self.slots = np.fromiter([item.slot for item in self.work], np.int64, len(self.work))
        self.sample_rows = np.flatnonzero(self.samples)


@dataclass(eq=False)
class StepOutput:
    """What a step's forward enqueued, on the device (nothing here waits for it): the ids
    sampled for the rows that sample, in row order, and their slots; the log-probabilities of
    the sampled tokens and of the prompt positions computed, for the requests that asked
    (None: none did); this rank's verdict on the step's proposals (``[2, R]``, None where it
    scored none: conveyor.worker.speculative_verify); the constrained rows the grammar ended."""

    sampled: torch.Tensor
    sample_slots: torch.Tensor
    logprobs: LogprobRows | None = None
    prompt_logprobs: LogprobRows | None = None
    verdict: torch.Tensor | None = None
    ends: list[tuple[int, str]] = field(default_factory=list)
    pooled: PooledRows | None = None  # the vectors of the pooling rows whose prompt this step ends
