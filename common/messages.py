"""Typed messages that cross the process seams inside Conveyor.

Every message is a dataclass registered with :func:`message` under a stable
one-byte-ish integer tag. :mod:`conveyor.common.codec` is the only code that
turns them into bytes and back. The client-facing protocol (maps sent by
clients in any language) is documented in docs/protocol.md and parsed by the
frontend; it is deliberately not made of these classes, so that internal
messages can stay positional and compact.

Invariants the receivers rely on:
- A request's prompt and sampling parameters travel to the worker exactly once
  (in :class:`NewRequestData`); later steps name it by id (:class:`CachedRequestData`)
  with only its newly allocated blocks.
- Token ids the worker sampled are not sent back to it: it appends them to its
  own copy of the request's tokens, so both sides agree on ``len(token_ids)``.
- A request the scheduler preempts or retires is listed in
  ``StepPlan.finished_request_ids`` so the worker can drop its state; a resumed
  request arrives again as :class:`NewRequestData` with all its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROTOCOL_VERSION = 1

# tag -> class; filled by @message. Tags are part of the wire format: never reuse one.
MESSAGE_TYPES: dict[int, type] = {}


def message(tag: int):
    """Class decorator registering a dataclass as a wire message under ``tag``."""

    def register(cls: type) -> type:
        if tag in MESSAGE_TYPES:
            raise ValueError(f"message tag {tag} already used by {MESSAGE_TYPES[tag].__name__}")
        cls.TAG = tag
        MESSAGE_TYPES[tag] = cls
        return cls

    return register


class FinishReason:
    """Why a request ended. Strings, because they are shown to clients as they are."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # the client aborted or went away
    ERROR = "error"  # rejected or failed; the output carries the message


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated by the frontend before they travel.

    ``top_k == 0`` and ``top_p == 1.0`` and ``min_p == 0.0`` disable those filters;
    ``temperature == 0`` means greedy. With a ``seed``, the randomness of each
    output position is derived from (seed, position), so a request samples the
    same tokens whatever it is batched with and even after a preemption.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ---------------------------------------------------------------- frontend -> scheduler


@message(1)
@dataclass
class AddRequest:
    """A tokenized request. ``arrival_time`` is the frontend's time.time() at receipt."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float


@message(2)
@dataclass
class AbortRequests:
    """Stop these requests now and free their blocks (client abort, disconnect, stop string)."""

    request_ids: list[str]


@message(3)
@dataclass
class StatsQuery:
    """Ask the scheduler for a :class:`SchedulerStats` snapshot, tagged with ``query_id``."""

    query_id: str


# ---------------------------------------------------------------- scheduler -> frontend


@message(10)
@dataclass
class RequestOutput:
    """New tokens of one request from one iteration; ``finish_reason`` set on its last one.

    Timing fields are absolute time.time() values on the scheduler's clock, set
    once: ``scheduled_time`` when first admitted, ``first_token_time`` when its
    first token was sampled. ``error`` explains a ``finish_reason == "error"``.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None


@message(11)
@dataclass
class TokenOutputs:
    """All request outputs of one scheduler iteration, sent as one message."""

    outputs: list[RequestOutput]


@message(12)
@dataclass
class SchedulerStats:
    """Block-pool and queue state; ``free_blocks + held_blocks == total_blocks`` always."""

    query_id: str
    total_blocks: int
    free_blocks: int
    held_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int


# ---------------------------------------------------------------- scheduler -> worker


@message(20)
@dataclass
class NewRequestData:
    """First appearance of a request at the worker (or after a preemption).

    ``token_ids`` is every token known so far (prompt, then outputs for a resumed
    request); ``block_ids`` its whole block table.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@message(21)
@dataclass
class CachedRequestData:
    """A request the worker already holds: run ``num_scheduled_tokens`` more of its tokens.

    ``new_block_ids`` are appended to its block table before the step runs.
    """

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@message(22)
@dataclass
class StepPlan:
    """One iteration's work. The worker samples a token for every scheduled request whose
    tokens are all computed after this step (``num_computed + num_scheduled == len(tokens)``)."""

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    finished_request_ids: list[str]


@message(23)
@dataclass
class Shutdown:
    """Ask a process to exit its loop cleanly; ``reason`` is logged and relayed to clients."""

    reason: str


# ---------------------------------------------------------------- worker -> scheduler


@message(30)
@dataclass
class StepResult:
    """Sampled tokens of one step, parallel lists. ``error`` set means the step failed and
    none of its requests advanced."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    error: str | None = None
    forward_time: float = 0.0


# ---------------------------------------------------------------- any child -> bin/serve


@message(40)
@dataclass
class ProcessReady:
    """Sent once by each child when it can take work. ``info`` carries what others need
    from it (the worker reports its KV block count)."""

    process: str
    pid: int
    info: dict[str, int | str | float | bool] = field(default_factory=dict)


@message(41)
@dataclass
class ProcessFailed:
    """Sent by a child that cannot start (bad model directory, no GPU): ``reason`` is shown."""

    process: str
    reason: str

