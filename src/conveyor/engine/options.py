"""``Engine(**config)``'s keyword arguments: which part of the engine each one configures.

The names are bin/serve's flags (``device``, ``dtype``, ``attention``, ``num_kv_blocks``,
``kv_cache_memory`` in GiB, ``kv_cache_dtype``, ``swap_space`` in GiB, ``threads``, ``block_size``,
``max_model_len``, ``max_sessions`` ...) and :class:`~conveyor.runtime.config.SchedulerConfig`'s
own fields for every knob of the batcher (``policy``, ``preemption``, ``max_waiting`` ...),
with the defaults bin/serve has (the config classes' own). TGI's names for the batch limits
are accepted by their meaning: ``max_batch_size`` is ``max_num_seqs`` (sequences in one
iteration) and ``max_batch_tokens`` is ``max_num_batched_tokens`` (the iteration's token
budget); ``min_batch_size`` and ``max_wait_ms`` are already the batcher's names. Naming a
knob twice (``max_batch_size`` and ``max_num_seqs``) is a ValueError, an unknown name a
TypeError.

What the settings become is bin/serve's assembly (:mod:`conveyor.assembly.build`): the
runner from :func:`~conveyor.assembly.build.worker_settings`, the batcher's config from
:func:`~conveyor.assembly.build.batcher_config`, validated before the model loads with the
least valid pool and sized after, as in bin/serve (``ServerConfig.sized_scheduler``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from conveyor.assembly.build import GIB
from conveyor.runtime.config import (
    KV_CACHE_MEMORY_BYTES,
    Attention,
    Device,
    Dtype,
    FrontendConfig,
    KVCacheDtype,
    RunnerConfig,
    SchedulerConfig,
    WorkerConfig,
)  # fmt: skip

# TGI's names -> the batcher's.
ALIASES = {"max_batch_size": "max_num_seqs", "max_batch_tokens": "max_num_batched_tokens"}
# SchedulerConfig fields that are not knobs here: sized by the runner, or set by the model.
_SIZED = frozenset({"num_blocks", "num_cpu_blocks", "block_bytes", "block_size", "max_model_len", "lora_names"})
SCHEDULER_KNOBS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig)) - _SIZED


@dataclass(frozen=True)
class EngineOptions:
    """The engine's configuration: the settings bin/serve has a flag for, and the batcher's knobs."""

    device: str = Device.AUTO
    dtype: str = Dtype.AUTO
    quantization: str = RunnerConfig.quantization  # bin/serve --quantization
    attention: str = Attention.AUTO
    block_size: int = SchedulerConfig.block_size
    num_kv_blocks: int | None = None  # KV-cache blocks; None: as many as kv_cache_memory holds
    kv_cache_memory: float = KV_CACHE_MEMORY_BYTES / GIB  # GiB, when num_kv_blocks is not given
    kv_cache_dtype: str = KVCacheDtype.AUTO  # fp8 / int8: 8-bit KV cache (twice the blocks of a 16-bit one)
    num_cpu_blocks: int | None = None  # CPU swap space in blocks (instead of swap_space)
    swap_space: float | None = None  # GiB; None: the device's default (4 with cuda, 0 on CPU)
    threads: int | None = None  # torch CPU threads
    enforce_eager: bool = RunnerConfig.enforce_eager  # no CUDA graphs for decode steps
    batch_invariant: bool = RunnerConfig.batch_invariant  # a request's bits independent of its batch
    max_model_len: int | None = None  # prompt + output; None: the model's max_position_embeddings
    max_sessions: int = FrontendConfig.max_sessions  # finished requests remembered for continuation
    # LoRA adapters requests may name: {name: PEFT directory} (bin/serve --lora-modules); the
    # slots are the batcher's knob max_loras
    lora_modules: dict[str, str] | None = None
    enable_lora: bool = RunnerConfig.enable_lora  # LoRA on even without lora_modules: Engine.load_lora adds adapters
    max_lora_rank: int = RunnerConfig.max_lora_rank
    max_cpu_loras: int | None = RunnerConfig.max_cpu_loras  # host copies of adapters; None: as many as slots
    max_logprobs: int = FrontendConfig.max_logprobs  # the most top log-probabilities a request may ask for
    # Ranks the model is split over (bin/serve --tensor-parallel-size): this process is rank 0,
    # the others worker processes (conveyor.engine.ranks); gloo on CPU, one GPU per rank on CUDA
    tensor_parallel_size: int = WorkerConfig.tensor_parallel_size
    distributed_timeout_s: float = WorkerConfig.distributed_timeout_s  # the ranks' start-up and every collective
    expert_parallel: bool = WorkerConfig.expert_parallel  # a MoE model's experts split whole over the ranks
    scheduler: dict[str, Any] = field(default_factory=dict)  # SchedulerConfig knobs by their names

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer of at least 1, got {size!r}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s!r}")

    @classmethod
    def from_kwargs(cls, config: dict[str, Any]) -> EngineOptions:
        """Sort ``Engine(**config)`` into the parts; TypeError for an unknown name, ValueError
        for a knob given under both its names."""
        own = {f.name for f in dataclasses.fields(cls)} - {"scheduler"}
        direct: dict[str, Any] = {}
        knobs: dict[str, Any] = {}
        for name, value in config.items():
            if name in own:
                direct[name] = value
                continue
            knob = ALIASES.get(name, name)
            if knob not in SCHEDULER_KNOBS:
                raise TypeError(f"Engine() got an unexpected keyword argument {name!r}")
            if knob in knobs:
                other = next(n for n in config if n != name and ALIASES.get(n, n) == knob)
                raise ValueError(f"{name!r} and {other!r} are the same setting ({knob}): give one of them")
            knobs[knob] = value
        return cls(**direct, scheduler=knobs)

    def settings(self) -> dict[str, Any]:
        """Every setting by bin/serve's name for it (the batcher's knobs by their own), as
        :mod:`conveyor.assembly.build` takes them; ``max_num_seqs`` always, since the runner
        sizes its decode buffers by it."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "scheduler"}
        return {**own, "max_num_seqs": SchedulerConfig.max_num_seqs, **self.scheduler}
