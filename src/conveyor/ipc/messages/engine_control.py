"""What an RL trainer asks of a running server between training steps (tags 70-79): new
weights, sleep and wake, pause and continue (docs/rl.md).

A client's command travels frontend -> every live replica's scheduler. :class:`PauseGeneration`,
:class:`ContinueGeneration` and :class:`EngineStateQuery` are the scheduler's alone and
answered at once (a ``wait`` pause once what runs has finished). :class:`UpdateWeights`,
:class:`SleepEngine` and :class:`WakeEngine` first end what is in flight (finish or abort, as
``in_flight`` says, holding new requests meanwhile), then go to every worker rank on the plan
channel, between two steps; rank 0 answers :class:`EngineControlled` and the scheduler,
having applied its part (prefix cache dropped, weight version bumped), answers the frontend
with its state.
"""

from __future__ import annotations

from conveyor.ipc.messages.tagged import Message, Positional, message

# in_flight of an update or a sleep: the requests running then first finish (on the old
# weights) or are aborted with the reason. mode of a pause (vLLM's): abort what runs, wait for
# it to finish, or keep it where it is (it resumes on continue).
FINISH = "finish"
ABORT = "abort"
WAIT = "wait"
KEEP = "keep"
IN_FLIGHT_MODES = (FINISH, ABORT)
PAUSE_MODES = (ABORT, WAIT, KEEP)

# EngineControlled.code: "ok" or why a command was refused (the client protocol's error codes).
CONTROL_OK = "ok"
CONTROL_INVALID = "invalid_control"  # the command cannot apply now (paused with requests to finish, ...)
WEIGHTS_INVALID = "invalid_weights"  # the update does not fit the model (names, shapes), nothing changed
WEIGHTS_NOT_FOUND = "weights_not_found"  # the checkpoint directory or a file of it is not there


class WeightSpecs(Positional):
    """The tensors of an update, in the order they are sent: checkpoint names, torch dtype
    names (``float32``, ``bfloat16``, ...) and shapes."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class WeightGroup(Positional):
    """A trainer's ``torch.distributed`` group to receive an update from: hosted at
    ``address`` (``host:port``) by the trainer's broadcasting rank 0, ``world_size`` members;
    this server's tensor-parallel rank r is member ``rank_offset + r``."""

    address: str
    rank_offset: int
    world_size: int
    specs: WeightSpecs
    timeout_s: float = 300.0


@message
class UpdateWeights(Message, tag=70):
    """New weights in place, from exactly one source: the checkpoint directory ``path`` (on
    the worker's host), the trainer's ``group``, or (``conveyor.Engine`` under tensor
    parallelism) tensors rank 0 broadcasts over the ranks' own group (``from_rank0``)."""

    query_id: str
    in_flight: str = FINISH
    path: str | None = None
    group: WeightGroup | None = None
    from_rank0: WeightSpecs | None = None


@message
class SleepEngine(Message, tag=71):
    """Free the KV cache (``level`` 1) and the weights too (2, read again from the served
    checkpoint on wake)."""

    query_id: str
    level: int = 1
    in_flight: str = FINISH


@message
class WakeEngine(Message, tag=72):
    query_id: str


@message
class PauseGeneration(Message, tag=73):
    """Stop stepping: ``mode`` :data:`ABORT`, :data:`WAIT` or :data:`KEEP` what runs. Requests
    that arrive while paused wait."""

    query_id: str
    mode: str = ABORT


@message
class ContinueGeneration(Message, tag=74):
    query_id: str


@message
class EngineStateQuery(Message, tag=75):
    """Ask the scheduler for its :class:`EngineControlled` state (is_sleeping, is_paused)."""

    query_id: str


@message
class EngineControlled(Message, tag=76):
    """The answer to a command of ``query_id``: ``code`` :data:`CONTROL_OK` or why it was
    refused (``error``), and the state after it. Worker rank 0 answers the scheduler with
    ``freed_bytes`` (a sleep's); the scheduler fills in the rest."""

    query_id: str
    code: str = CONTROL_OK
    error: str | None = None
    weight_version: int = 0
    sleep_level: int = 0
    paused: bool = False
    freed_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.code == CONTROL_OK
