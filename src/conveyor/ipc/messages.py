"""Typed messages that cross the process seams inside Conveyor.

Every message is a :class:`Message`, a ``msgspec.Struct`` that travels as a positional
msgpack array led by its stable integer tag (the class keyword ``tag=``), registered
with :func:`message`; the structs nested in messages are :class:`Positional`.
:mod:`conveyor.ipc.codec` is the only code that turns them into bytes and back. Structs,
not dataclasses: msgspec encodes and validates them in C, which bench/codec.py measured
faster than the hand-built codec over dataclasses it replaced, for every message
(bench/results/codec.json). They have no ``__dict__``: list fields with
``msgspec.structs.fields``, copy with ``msgspec.structs.replace``, map with
``msgspec.structs.asdict``. The client-facing protocol (maps sent by
clients in any language) is documented in docs/protocol.md and parsed by the
frontend; it is deliberately not made of these classes, so that internal
messages can stay positional and compact.

Invariants the receivers rely on:
- A request's prompt and sampling parameters travel to the worker exactly once
  (in :class:`NewRequestData`); later steps name it by its *slot* (a row of
  :class:`CachedRequests`) with only its newly allocated blocks.
- Slots: on the scheduler <-> worker hop a request is named by a small integer, its slot
  (``0 .. max_num_seqs - 1``), given by the scheduler when it sends the request as
  NewRequestData and taken back when it lists the slot in ``StepPlan.finished_slots``. The
  request id travels only in NewRequestData (for the worker's error messages). A slot
  names at most one request at a time; it may be given to a new request in the very plan
  that drops it, since the worker drops before it adds (below).
- Token ids the worker sampled are not sent back to it: it appends them to its
  own copy of the request's tokens, so both sides agree on ``len(token_ids)``.
- A request the scheduler preempts or retires has its slot listed in
  ``StepPlan.finished_slots`` so the worker can drop its state; a resumed
  request arrives again as :class:`NewRequestData` (maybe on another slot) with all its
  tokens, and with ``num_computed_tokens > 0`` when its KV is already in the blocks it
  names (prefix-cache hits, or blocks swapped back in by the same plan).
- The worker executes a plan in this order: drop ``finished_slots``, run every
  ``swap_out`` copy, then every ``swap_in`` copy, then the forward; ``new_requests`` are
  taken in after the drop. See :class:`StepPlan` for why that order makes same-plan block
  and slot reuse safe.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import numpy as np
from msgspec import field

PROTOCOL_VERSION = 4  # 4: msgspec Structs, Int32Array as msgpack ext

# Slots a scheduler may hand out (its max_num_seqs is at most this); a worker refuses any
# other, so a corrupt plan cannot make it grow its slot table without bound.
MAX_SLOTS = 1 << 20

# A 1-D int32 column (token ids, block ids, per-request counts). It travels as raw
# little-endian bytes (a msgpack ext) and arrives as a numpy view over the received buffer
# (see conveyor.ipc.codec). Senders may fill it with any sequence of ints; receivers must
# treat it as a numpy array, and copy what they keep.
Int32Array = np.ndarray


class Positional(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A struct nested in messages: encoded as the array of its fields, in order. Decoding
    refuses an array longer than the fields; a shorter one is completed by the defaults
    of the missing trailing fields (msgspec's rule for array_like structs)."""


class Message(Positional):
    """A wire message: a :class:`Positional` whose class keyword ``tag=`` (an int, part of
    the wire format: never reuse one) leads its array. Register it with :func:`message`."""

    TAG: ClassVar[int]


# tag -> class; filled by @message.
MESSAGE_TYPES: dict[int, type[Message]] = {}


def message(cls: type[Message]) -> type[Message]:
    """Class decorator registering a Message under its tag (also set as ``cls.TAG``)."""
    tag = cls.__struct_config__.tag
    if type(tag) is not int:
        raise TypeError(f"message {cls.__name__} needs an int tag=, got {tag!r}")
    if tag in MESSAGE_TYPES:
        raise ValueError(f"message tag {tag} already used by {MESSAGE_TYPES[tag].__name__}")
    cls.TAG = tag
    MESSAGE_TYPES[tag] = cls
    return cls


class FinishReason:
    """Why a request ended. Strings, because they are shown to clients as they are."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # the client aborted or went away
    ERROR = "error"  # rejected or failed; the output carries the message


class SamplingParams(Positional, frozen=True):
    """Per-request sampling parameters, validated by the frontend before they travel.

    ``top_k == 0`` and ``top_p == 1.0`` and ``min_p == 0.0`` disable those filters;
    ``temperature == 0`` means greedy. With a ``seed``, the randomness of each
    output position is derived from (seed, position), so a request samples the
    same tokens whatever it is batched with and even after a preemption.

    The sampling controls (vLLM's definitions, applied on the device before temperature,
    :mod:`conveyor.worker.sampling_controls`; each neutral at its default):
    ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] subtract ``p`` once / ``f`` per
    occurrence from the logit of every token already in the *output*; ``repetition_penalty``
    (> 0) divides the positive logits and multiplies the negative ones of every token in the
    prompt or the output; ``logit_bias`` adds a bias in [-100, 100] to a token's logit (at
    most :data:`MAX_LOGIT_BIAS` entries); ``min_tokens`` (<= ``max_tokens``) masks the stop
    ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) until that many tokens are out.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Parallel sampling: ``n`` sequences of one prompt, sharing its KV (the scheduler fans
    # the request out into sequences ``{request_id}/{i}``, see scheduler/groups.py); sequence
    # i draws with ``seed + i``. The worker never reads it.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: the compiled constraint in llguidance's serialized grammar form
    # (conveyor.structured), "" for none. The frontend compiles and validates it; the worker
    # rebuilds a matcher from it with the same tokenizer and masks the request's rows with it
    # (docs/structured-output.md). The scheduler never reads it.
    grammar: str = ""
    # Log-probabilities (log-softmax of the raw logits): None asks for none; k >= 0 asks for
    # the sampled (prompt) token's and the k most likely ones', k at most the server's
    # max_logprobs (checked by the frontend).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Any of the three penalties is set (the worker then counts the output's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def controlled(self) -> bool:
        """Any sampling control is set: the request needs per-slot state on the worker."""
        return self.penalized or self.min_tokens > 0 or bool(self.logit_bias)


#: Most ``logit_bias`` entries one request may carry (each a dense row write on the worker).
MAX_LOGIT_BIAS = 1024


# The scheduler id of sequence ``i`` of a parallel-sampling request ``rid`` is ``rid/i``: the
# frontend and the engine name their scheduler ids by a counter ("1", "2", ...), never with
# this separator, so an output's id tells a sequence from a request.
SEQUENCE_SEPARATOR = "/"


def sequence_id(request_id: str, index: int) -> str:
    """The scheduler id of sequence ``index`` of a parallel-sampling request (its outputs' id)."""
    return f"{request_id}{SEQUENCE_SEPARATOR}{index}"


# ---------------------------------------------------------------- frontend -> scheduler


@message
class AddRequest(Message, tag=1):
    """A tokenized request. ``arrival_time`` is the frontend's time.time() at receipt.

    ``prompt_token_ids``, the largest payload of the hop, travels as a raw int32 array like
    the plan's columns: the scheduler copies it into its request state on receipt."""

    request_id: str
    prompt_token_ids: Int32Array
    sampling: SamplingParams
    arrival_time: float
    # Higher is served sooner under the "priority" policy; ignored under "fcfs".
    priority: int = 0
    # The LoRA adapter to run under (a name the server registered); None: the base model.
    lora: str | None = None


@message
class AbortRequests(Message, tag=2):
    """Stop these requests now and free their blocks (client abort, disconnect, stop string)."""

    request_ids: list[str]


@message
class StatsQuery(Message, tag=3):
    """Ask the scheduler for a :class:`SchedulerStats` snapshot, tagged with ``query_id``."""

    query_id: str


# ---------------------------------------------------------------- scheduler -> frontend


class TokenLogprobs(Positional):
    """Log-probabilities of ``count`` consecutive tokens of one request, as columns.

    ``start`` is the index in the request's whole sequence (prompt then output) of the first
    token they describe; row ``i`` is token ``start + i``: ``token_logprobs`` holds its
    log-probability (little-endian float32 bytes, ``count`` of them), ``top_ids`` and
    ``top_logprobs`` the ``width`` most likely tokens at that position, most likely first
    (``count * width`` int32 ids and float32 bytes, row-major). Bytes and int32 columns, not
    objects per token: they ride the token hot path."""

    start: int
    count: int
    width: int
    token_logprobs: bytes
    top_ids: Int32Array
    top_logprobs: bytes


class StepLogprobs(Positional):
    """Log-probabilities a step computed, for several requests (named by slot), as columns:
    request ``slots[i]`` has ``counts[i]`` rows from sequence index ``starts[i]`` on, laid end to
    end in the arrays, which are as in :class:`TokenLogprobs` (one ``width`` for the step)."""

    slots: Int32Array
    starts: Int32Array
    counts: Int32Array
    width: int
    token_logprobs: bytes
    top_ids: Int32Array
    top_logprobs: bytes


@message
class RequestOutput(Message, tag=10):
    """New tokens of one request from one iteration; ``finish_reason`` set on its last one.

    Timing fields are absolute time.time() values on the scheduler's clock, set
    once: ``scheduled_time`` when first admitted, ``first_token_time`` when its
    first token was sampled. ``error`` explains a ``finish_reason == "error"``; it
    starts with ``overloaded:`` or ``timeout:`` for a request the bounded queue
    refused or gave up on. ``num_cached_tokens``: prompt tokens whose KV came from
    the prefix cache at first admission (set with ``scheduled_time``).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    # Requests that asked for them: the log-probabilities of new_token_ids (same count), and
    # of prompt tokens computed by this iteration (the first prompt token has none).
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


@message
class TokenOutputs(Message, tag=11):
    """All request outputs of one scheduler iteration, sent as one message.

    The common case travels as two parallel columns: ``request_ids[i]`` got the one new token
    ``token_ids[i]`` and nothing else about it changed (not its first token, not finished).
    Everything else (a first token, which carries the timing fields; a finish; an error or
    rejection) is a full :class:`RequestOutput` in ``outputs``. A request in the columns has
    no entry in ``outputs`` of the same message, so the order of the two does not matter;
    receivers apply ``outputs`` first, then the columns. Columns because
    one small object per decoding request per iteration was most of the scheduler's update
    cost (and of the codec's).
    """

    outputs: list[RequestOutput]
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


# Upper bounds of the iteration-tokens histogram of SchedulerStats (tokens one forward runs).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@message
class SchedulerStats(Message, tag=12):
    """Block-pool and queue state, counters since start, and the most recent iterations.

    ``free_blocks + cached_blocks + held_blocks == total_blocks`` always (cached: holds a
    prefix-cache entry, referenced by no request, reusable or evictable); the CPU swap
    space likewise with ``swapped_blocks`` for the held ones. ``recent_iterations`` rows
    are ordered as ``iteration_fields`` names them (see docs/protocol.md).
    """

    query_id: str
    total_blocks: int
    free_blocks: int
    held_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    cached_blocks: int = 0
    total_cpu_blocks: int = 0
    free_cpu_blocks: int = 0
    cached_cpu_blocks: int = 0
    swapped_blocks: int = 0
    num_swapped: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_overloaded: int = 0
    num_timed_out: int = 0
    num_planned_ahead: int = 0
    # Speculative decoding since start: decode rows that verified a proposal, tokens proposed,
    # proposed tokens accepted (acceptance rate: accepted / proposed).
    spec_num_proposals: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Every iteration's input tokens since start, per bucket of
    # ITERATION_TOKEN_BUCKETS (the last above every bound), and their sum.
    iteration_token_counts: list[int] = field(default_factory=list)
    iteration_token_sum: int = 0
    iteration_fields: list[str] = field(default_factory=list)
    recent_iterations: list[list[int | float]] = field(default_factory=list)


# ---------------------------------------------------------------- scheduler -> worker


@message
class NewRequestData(Message, tag=20):
    """First appearance of a request at the worker (or after a preemption).

    ``slot`` is the name later plans give it (their cached rows, ``finished_slots``): free on
    the worker once this plan's ``finished_slots`` are dropped. ``request_id`` travels only
    here, for the worker's messages. ``token_ids`` is every token known so far (prompt, then
    outputs for a resumed request); ``block_ids`` its whole block table.
    ``num_prompt_tokens``: how many of ``token_ids`` are the prompt (the rest are outputs,
    which presence/frequency penalties and ``min_tokens`` count); None: all of them.
    """

    request_id: str
    slot: int
    token_ids: Int32Array
    sampling: SamplingParams
    block_ids: Int32Array
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_prompt_tokens: int | None = None
    # The LoRA adapter the request runs under (its registered name; None: the base model).
    lora: str | None = None


def int_list(values: Int32Array | list[int]) -> list[int]:
    """A fresh list of the Python ints of an Int32Array field: a numpy view over a received
    message when decoded (which must not be kept: its buffer is reused), any sequence of ints
    when the message was built in-process."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


class CachedRequests(Positional):
    """Every request of a plan that the worker already holds, as parallel columns.

    Columns, not one object per request: a decode-heavy step names hundreds of running
    requests, and building, encoding and decoding one small object for each was most of
    the scheduler's per-iteration cost. Row ``i`` is the request on slot ``slots[i]``; the
    rows that get new blocks are listed in ``new_block_rows`` (increasing) with their blocks
    at the same index of ``new_block_ids``, since most steps give most requests none.
    """

    slots: Int32Array = field(default_factory=list)
    num_computed_tokens: Int32Array = field(default_factory=list)
    num_scheduled_tokens: Int32Array = field(default_factory=list)
    new_block_rows: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Speculative decoding: the rows (increasing) that verify proposed tokens, each with its
    # proposal at the same index of ``spec_token_ids``. Such a row runs its last known token
    # then the proposal (``num_scheduled_tokens == 1 + len(proposal)``); the worker accepts
    # greedily and reports the tokens gained in ``StepResult.spec_token_ids``.
    spec_rows: list[int] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.slots)


@message
class StepPlan(Message, tag=22):
    """One iteration's work. The worker samples a token for every scheduled request whose
    tokens are all computed after this step (``num_computed + num_scheduled == len(tokens)``).

    Requests are named by slot (see the module docstring). Order of execution: drop the
    requests on ``finished_slots``, all swap-outs, all swap-ins, the block copies, then the forward;
    ``new_requests`` are taken in after the drop. Dropping first is what lets the scheduler
    give a slot freed since the last plan (a finish, an abort, a preemption in this very
    plan) to a request this plan admits; plans before it, already sent, still name the
    slot's old owner, and the worker runs them first.

    ``swap_out`` lists ``[gpu_block, cpu_block]`` copies into the CPU swap space and
    ``swap_in`` ``[cpu_block, gpu_block]`` copies back; the worker batches each list. The
    scheduler frees a GPU block the moment it decides to swap it out (a preempted request's,
    or a cached block evicted to the CPU tier), and may hand it to another request in the
    same plan (as a fork's copy destination, a swap-in destination or for new KV): the
    copies out run first, so they read the old contents. A CPU block is given one content
    per plan: destinations within each list are distinct, and a CPU block that is both a
    swap-out destination and a swap-in source (a block evicted to the CPU tier and hit again
    by the same plan) is read after it was written.

    ``copy_blocks`` lists ``[src, dst]`` copies inside the GPU cache, run after the swaps: a
    sequence of a parallel-sampling request forking from its first sequence gets its own copy
    of the prompt's last, partly filled block. ``dst`` is freshly allocated to it and never a
    source, so it may be a block this plan swaps out (read before); ``src`` is held by the
    first sequence and may be a block this plan swaps in (the first sequence resumed by it:
    written before). The plan that forks a sequence never preempts either (a plan meets
    requests in rank order and preempts only those ranked below the one needing room), so no
    swap reads ``dst`` expecting the copy nor writes ``src``.

    ``planned_ahead``: the plan was formed while the previous one was in flight, assuming
    it succeeds (its requests' sampled tokens are the inputs of this plan's decodes). If the
    previous step failed, the worker fails this one too without running it: it only drops
    the finished slots.
    """

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: CachedRequests
    finished_slots: Int32Array
    swap_out: list[list[int]] = field(default_factory=list)
    swap_in: list[list[int]] = field(default_factory=list)
    planned_ahead: bool = False
    copy_blocks: list[list[int]] = field(default_factory=list)


@message
class Shutdown(Message, tag=23):
    """Ask a process to exit its loop cleanly; ``reason`` is logged and relayed to clients."""

    reason: str


# ---------------------------------------------------------------- worker -> scheduler


@message
class StepResult(Message, tag=30):
    """Sampled tokens of one step as parallel columns: the request on ``slots[i]`` sampled
    ``sampled_token_ids[i]``. Rows come in plan order: the new requests that sample, then
    the cached rows that do. ``error`` set means the step failed and none of its requests
    advanced.

    ``end_slots`` / ``end_errors``: constrained rows that the grammar ends (parallel lists).
    An empty error: the grammar is complete, the row's sampled token (end-of-sequence, the
    only one the grammar allowed) is its last and it finishes as ``stop``. A non-empty error:
    a dead end (no token allowed, or the matcher failed); its sampled token is not kept and it
    finishes as ``error`` with that message."""

    step_id: int
    slots: Int32Array
    sampled_token_ids: Int32Array
    error: str | None = None
    forward_time: float = 0.0
    end_slots: list[int] = field(default_factory=list)
    end_errors: list[str] = field(default_factory=list)
    # For the rows whose request asked: the sampled tokens' log-probabilities (one row per
    # slot, at the sampled token's index), and those of the prompt positions the step computed.
    logprobs: StepLogprobs | None = None
    prompt_logprobs: StepLogprobs | None = None
    # Speculative rows (the plan's ``spec_rows``): the request on ``spec_slots[i]`` advanced by
    # its ``sampled_token_ids`` row (the target's token at the first position) and then by the
    # tokens ``spec_token_ids[i]`` (the accepted proposals' successors; possibly none).
    spec_slots: list[int] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)


# ---------------------------------------------------------------- any child -> bin/serve


@message
class ProcessReady(Message, tag=40):
    """Sent once by each child when it can take work. ``info`` carries what others need
    from it (the worker reports its KV block count)."""

    process: str
    pid: int
    info: dict[str, int | str | float | bool] = field(default_factory=dict)


@message
class ProcessFailed(Message, tag=41):
    """Sent by a child that cannot start (bad model directory, no GPU): ``reason`` is shown.
    bin/serve also sends it to the frontend's control socket when a data-parallel replica's
    process dies and the others keep serving: ``process`` names it (``worker.1``), and the
    frontend fails that replica's requests alone."""

    process: str
    reason: str



# ---------------------------------------------------------------- profiling (tags 50-59)
# A `profile` client call travels frontend -> scheduler -> worker as ProfileQuery; the worker
# answers the scheduler between steps with a ProfileReport of its own snapshot, and the
# scheduler forwards it to the frontend with its own snapshot added. Snapshots are built by
# conveyor.profiling; timestamps are CLOCK_MONOTONIC nanoseconds, one clock for every
# process of a server (they share a host).


class MetricSummary(Positional):
    """One timer or value series over a profile's window.

    Timers are in milliseconds (``unit == "ms"``); value series name their own unit.
    ``count`` samples fell in the window and cover ``span_s`` seconds, which is shorter than
    the window when the bounded ring wrapped (the figures then describe the newest samples).
    """

    name: str
    unit: str
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    total: float
    span_s: float


class CounterSummary(Positional):
    """A monotone count: ``total`` since the process started, ``rate`` per second over the window."""

    name: str
    total: int
    rate: float


class SeriesSamples(Positional):
    """Raw samples of one value series inside the window, oldest first (for timelines)."""

    name: str
    unit: str
    ts_ns: list[int]
    values: list[float]


class TraceEvents(Positional):
    """Complete spans inside the window, oldest first, as parallel columns.

    Span ``i`` is named ``names[name_index[i]]``, started at ``start_ns[i]`` and lasted
    ``dur_ns[i]``; ``arg[i]`` (-1 for none) is the value of ``arg_names[name_index[i]]``,
    e.g. the step id that links a scheduler span to the worker's spans of the same step.
    """

    names: list[str]
    arg_names: list[str]
    name_index: list[int]
    start_ns: list[int]
    dur_ns: list[int]
    arg: list[int]


class ProcessProfile(Positional):
    """One process's snapshot. ``now_ns`` is its CLOCK_MONOTONIC when taken;
    ``wall_offset_ns`` is ``time.time_ns() - now_ns`` then, to place the trace in wall time."""

    process: str
    pid: int
    tid: int
    enabled: bool
    now_ns: int
    wall_offset_ns: int
    uptime_s: float
    window_s: float
    metrics: list[MetricSummary]
    counters: list[CounterSummary]
    values: dict[str, float]
    series: list[SeriesSamples]
    trace: TraceEvents | None = None


@message
class ProfileQuery(Message, tag=50):
    """Ask for profile snapshots over the last ``window_s`` seconds; ``trace`` adds the spans,
    ``series`` names the value series whose raw samples to include."""

    query_id: str
    window_s: float
    trace: bool = False
    series: list[str] = field(default_factory=list)


@message
class ProfileReport(Message, tag=51):
    """Snapshots answering the ProfileQuery ``query_id``: the worker's alone, or the
    scheduler's followed by the worker's."""

    query_id: str
    profiles: list[ProcessProfile]
