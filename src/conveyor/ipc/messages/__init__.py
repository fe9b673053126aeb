"""Typed messages that cross the process seams inside Conveyor, one module per seam.

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

The modules: :mod:`~conveyor.ipc.messages.tagged` (the frame: :class:`Message`, its tag
registry, :class:`Positional`, :data:`Int32Array`), :mod:`~conveyor.ipc.messages.frontend_scheduler`
(requests in, tokens and stats out), :mod:`~conveyor.ipc.messages.scheduler_worker` (plans and
results, with the invariants their receivers rely on), :mod:`~conveyor.ipc.messages.process_control`
(ready, failed, shutdown), :mod:`~conveyor.ipc.messages.profile_reports` and
:mod:`~conveyor.ipc.messages.lora_updates` (adapters loaded and unloaded while serving),
:mod:`~conveyor.ipc.messages.engine_control` (weight updates, sleep, pause: docs/rl.md). Every name is
re-exported here, and importing this package registers every message type.
"""

from __future__ import annotations

from conveyor.ipc.messages.engine_control import (
    ContinueGeneration,
    EngineControlled,
    EngineStateQuery,
    PauseGeneration,
    SleepEngine,
    UpdateWeights,
    WakeEngine,
    WeightGroup,
    WeightSpecs,
)
from conveyor.ipc.messages.frontend_scheduler import (
    ITERATION_TOKEN_BUCKETS,
    MAX_LOGIT_BIAS,
    SEQUENCE_SEPARATOR,
    AbortRequests,
    AddRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
    StatsQuery,
    TokenLogprobs,
    TokenOutputs,
    sequence_id,
    speculation_rates,
)
from conveyor.ipc.messages.lora_updates import (
    LORA_ALREADY_LOADED,
    LORA_IN_USE,
    LORA_INVALID,
    LORA_NOT_FOUND,
    LORA_OK,
    CommitLora,
    LoadLora,
    LoraRead,
    LoraUpdated,
    UnloadLora,
)
from conveyor.ipc.messages.process_control import (
    NodeHello,
    NodeVerdict,
    ProcessFailed,
    ProcessReady,
    Shutdown,
)
from conveyor.ipc.messages.profile_reports import (
    CounterSummary,
    MetricSummary,
    ProcessProfile,
    ProfileQuery,
    ProfileReport,
    SeriesSamples,
    TraceEvents,
)
from conveyor.ipc.messages.scheduler_worker import (
    MAX_SLOTS,
    CachedRequests,
    NewRequestData,
    StepLogprobs,
    StepPlan,
    StepResult,
    int_list,
)
from conveyor.ipc.messages.tagged import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Int32Array,
    Message,
    Positional,
    message,
)

__all__ = [
    "ContinueGeneration",
    "EngineControlled",
    "EngineStateQuery",
    "PauseGeneration",
    "SleepEngine",
    "UpdateWeights",
    "WakeEngine",
    "WeightGroup",
    "WeightSpecs",
    "AbortRequests",
    "AddRequest",
    "CachedRequests",
    "CommitLora",
    "CounterSummary",
    "FinishReason",
    "ITERATION_TOKEN_BUCKETS",
    "Int32Array",
    "LORA_ALREADY_LOADED",
    "LORA_IN_USE",
    "LORA_INVALID",
    "LORA_NOT_FOUND",
    "LORA_OK",
    "LoadLora",
    "LoraRead",
    "LoraUpdated",
    "MAX_LOGIT_BIAS",
    "MAX_SLOTS",
    "MESSAGE_TYPES",
    "Message",
    "MetricSummary",
    "NewRequestData",
    "NodeHello",
    "NodeVerdict",
    "PROTOCOL_VERSION",
    "Positional",
    "ProcessFailed",
    "ProcessProfile",
    "ProcessReady",
    "ProfileQuery",
    "ProfileReport",
    "RequestOutput",
    "SEQUENCE_SEPARATOR",
    "SamplingParams",
    "SchedulerStats",
    "SeriesSamples",
    "Shutdown",
    "StatsQuery",
    "StepLogprobs",
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
    "TokenOutputs",
    "TraceEvents",
    "UnloadLora",
    "int_list",
    "message",
    "sequence_id",
    "speculation_rates",
]
