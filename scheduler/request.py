"""One request's state as the scheduler sees it.

Token-centric: a request is a token list (prompt, then the outputs sampled so far) and
``num_computed_tokens``, how many of those tokens have their KV in the cache. Whatever
lies between is what the next steps must run: the rest of a prompt (prefill, maybe in
chunks), or the single last-sampled token (decode). A preempted request keeps its outputs
and drops to ``num_computed_tokens == 0``, so resuming it is just a longer prefill.

Invariants the scheduler keeps:
- RUNNING: holds blocks covering at least ``num_computed_tokens`` tokens, and
  ``num_computed_tokens < num_tokens`` between steps (there is always a token to run).
- WAITING / PREEMPTED / FINISHED: holds no blocks and ``num_computed_tokens == 0``
  (FINISHED keeps whatever count it had; nothing reads it).
- ``worker_has_state`` is true from the plan that sends the request as NewRequestData
  until its id is queued for ``finished_request_ids``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.common.messages import AddRequest, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # in the batch: prefilling or decoding
    PREEMPTED = "preempted"  # was running, blocks dropped, queued again for recompute
    FINISHED = "finished"  # retired; blocks freed


@dataclass(eq=False, slots=True)
class Request:
    """Mutable per-request state. Compared by identity: ids can be reused after a request ends."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    scheduled_time: float | None = None  # time.time() of first admission
    first_token_time: float | None = None  # time.time() when the first output arrived
    worker_has_state: bool = False
    finish_reason: str | None = None

    @classmethod
    def from_message(cls, msg: AddRequest) -> Request:
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling=msg.sampling,
            arrival_time=msg.arrival_time,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """A fresh list of prompt + outputs (a copy: plans must not alias live state)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_live(self) -> bool:
        return self.status is not RequestStatus.FINISHED
