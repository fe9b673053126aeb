"""Messages between the frontend and the scheduler: requests in (:class:`AddRequest` with its
:class:`SamplingParams`, aborts, stats queries), tokens and stats out (:class:`RequestOutput`,
:class:`TokenOutputs`, :class:`SchedulerStats`). :class:`SamplingParams` also travels on to the
worker, inside :class:`~conveyor.ipc.messages.scheduler_worker.NewRequestData`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from msgspec import field

from conveyor.ipc.messages.tagged import Int32Array, Message, Positional, message


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
    # Whether the request's decodes may verify proposed tokens when the server speculates
    # (scheduler/speculation.py); false opts out. The output's distribution is the same
    # either way; the worker never reads it.
    speculate: bool = True
    # Pooling (an embedding request): "last" or "mean" pooling of the final hidden states over
    # the prompt, L2-normalized; "" for none. Such a request is prompt-only: it samples no
    # token, holds no KV past its last prefill chunk and finishes with its pooled vector
    # (RequestOutput.embedding; conveyor.worker.pooling computes it).
    pooling: str = ""

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
    # A pooling request's final: its pooled vector, little-endian float32 bytes.
    embedding: bytes | None = None
    # On a request's final: the weight version (updates since start) it ran on, all of it (an
    # update waits until what runs has finished or is aborted: conveyor.ipc.messages.engine_control).
    weight_version: int | None = None


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
    # proposed tokens accepted, accepted ones by position in their proposal (entry i: the
    # proposals whose first i + 1 tokens were accepted), steps that verified any, and steps the
    # batch-size rule kept from proposing. speculation_rates() derives the ratios.
    spec_num_proposals: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_num_steps: int = 0
    spec_num_limited_steps: int = 0
    # Every iteration's input tokens since start, per bucket of
    # ITERATION_TOKEN_BUCKETS (the last above every bound), and their sum.
    iteration_token_counts: list[int] = field(default_factory=list)
    iteration_token_sum: int = 0
    iteration_fields: list[str] = field(default_factory=list)
    recent_iterations: list[list[int | float]] = field(default_factory=list)
    # The LoRA adapters requests may name now (--lora-modules and those loaded since).
    lora_adapters: list[str] = field(default_factory=list)
    # Workers hung now (no step result within --hang-timeout; conveyor.scheduler.liveness):
    # /health answers 503 while any is.
    num_hung: int = 0


def speculation_rates(stats: Mapping[str, Any]) -> dict[str, float]:
    """The speculative-decoding ratios of a stats map's counters (0.0 before any proposal):
    ``spec_acceptance_rate`` (accepted / proposed tokens), ``spec_mean_acceptance_length``
    (tokens a verifying row gains per step: 1 + accepted / proposals, vLLM's mean acceptance
    length) and ``spec_proposals_per_step`` (proposals / steps that verified any). Derived
    where the map is read (the ``stats`` reply, ``Engine.stats``), so replicas' counters are
    summed first."""
    proposals, proposed = stats["spec_num_proposals"], stats["spec_proposed_tokens"]
    accepted, steps = stats["spec_accepted_tokens"], stats["spec_num_steps"]
    return {
        "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_mean_acceptance_length": 1 + accepted / proposals if proposals else 0.0,
        "spec_proposals_per_step": proposals / steps if steps else 0.0,
    }
