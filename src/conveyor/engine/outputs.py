"""What the engine hands back: one iteration's changes (:class:`StepOutput`) with its batch's
shape (:class:`BatchInfo`), and a finished request of an offline job (:class:`Result`).

:class:`BatchInfo` is the scheduler's own record of the iteration, the row its iteration log
keeps for the stats reply (:data:`conveyor.scheduler.iteration_log.ITERATION_FIELDS`, recorded by
``Scheduler._record`` when the plan is formed), under the names a batcher's caller knows:
the batch's size in requests, its input tokens (prefill + decode), and the requests it
admitted for the first time with their average and longest wait since they were added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.scheduler.iteration_log import ITERATION_FIELDS

if TYPE_CHECKING:
    from conveyor.engine.request import Request
    from conveyor.frontend.logprobs import Logprob


@dataclass(frozen=True)
class BatchInfo:
    """The shape of one iteration's batch. Waits are seconds from ``add_request`` to the
    admission (0 when nobody was admitted); ``row`` is the whole iteration-log row, by field."""

    step: int
    batch_size: int  # requests in the batch (decodes, prefill chunks, admissions)
    input_tokens: int  # prefill_tokens + decode_tokens: the forward's size in tokens
    prefill_tokens: int
    decode_tokens: int
    num_admitted: int  # requests admitted for the first time in this iteration
    avg_wait: float
    max_wait: float
    row: dict[str, int | float]

    @classmethod
    def from_row(cls, row: dict[str, int | float]) -> BatchInfo:
        assert tuple(row) == ITERATION_FIELDS, "the iteration log's fields changed"
        return cls(
            step=int(row["step"]),
            batch_size=int(row["batch_size"]),
            input_tokens=int(row["input_tokens"]),
            prefill_tokens=int(row["prefill_tokens"]),
            decode_tokens=int(row["decode_tokens"]),
            num_admitted=int(row["admitted"]),
            avg_wait=float(row["avg_wait"]),
            max_wait=float(row["max_wait"]),
            row=row,
        )


@dataclass(frozen=True)
class StepOutput:
    """What one :meth:`Engine.step` changed: ``requests`` that got tokens or finished (in the
    order the scheduler reported them; a request ended by a stop string, a queue timeout or a
    failed step is among them), and the ``batch`` that ran (None when nothing could run: no
    request, or the admission gate of ``min_batch_size`` / ``max_wait_ms`` still waiting)."""

    requests: list[Request]
    batch: BatchInfo | None

    @property
    def finished(self) -> list[Request]:
        return [r for r in self.requests if r.done]


@dataclass(frozen=True)
class CompletionOutput:
    """One sequence of a request: its index (0 .. n - 1), text, tokens and why it ended, and
    its output's log-probabilities where asked for (:attr:`Request.logprobs`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[Logprob] | None = None


@dataclass(frozen=True)
class Result:
    """One prompt's outcome in :meth:`Engine.generate`: ``outputs`` its ``n`` sequences;
    ``text``, ``token_ids`` are sequence 0's, ``finish_reason`` the request's."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None
    num_cached_tokens: int
    outputs: list[CompletionOutput]

    @classmethod
    def of(cls, req: Request) -> Result:
        outputs = [CompletionOutput(s.index, s.text, s.tokens, s.finish_reason, s.logprobs) for s in req.outputs]
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.text,
            req.tokens,
            req.finish_reason,
            req.error,
            req.num_cached_tokens,
            outputs,
        )
