"""``Engine(**config)``'s keyword arguments: which part of the engine each one configures.

The names are bin/serve's flags (``device``, ``dtype``, ``attention``, ``num_kv_blocks``,
``kv_cache_memory`` in GiB, ``swap_space`` in GiB, ``threads``, ``block_size``,
``max_model_len``, ``max_sessions`` ...) and :class:`~conveyor.runtime.config.SchedulerConfig`'s
own fields for every knob of the batcher (``policy``, ``preemption``, ``max_waiting`` ...),
with the defaults bin/serve has. TGI's names for the batch limits are accepted by their
meaning: ``max_batch_size`` is ``max_num_seqs`` (sequences in one iteration) and
``max_batch_tokens`` is ``max_num_batched_tokens`` (the iteration's token budget);
``min_batch_size`` and ``max_wait_ms`` are already the batcher's names. Naming a knob twice
(``max_batch_size`` and ``max_num_seqs``) is a ValueError, an unknown name a TypeError.

The KV pool's fields of the batcher (``num_blocks``, ``num_cpu_blocks``, ``block_bytes``)
are the runner's to tell, as in bin/serve (``ServerConfig.sized_scheduler``): the scheduler
config is validated before the model loads, with the least valid pool, and sized after.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from conveyor.runtime.config import Attention, Device, Dtype, FrontendConfig, SchedulerConfig

# TGI's names -> the batcher's.
ALIASES = {"max_batch_size": "max_num_seqs", "max_batch_tokens": "max_num_batched_tokens"}
# SchedulerConfig fields that are not knobs here: sized by the runner, or set by the model.
_SIZED = frozenset({"num_blocks", "num_cpu_blocks", "block_bytes", "block_size", "max_model_len"})
SCHEDULER_KNOBS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig)) - _SIZED
DEFAULT_KV_CACHE_GIB = 1.0  # bin/serve's --kv-cache-memory default


@dataclass(frozen=True)
class EngineOptions:
    """The engine's configuration, split by the part it configures."""

    device: str = Device.AUTO
    dtype: str = Dtype.AUTO
    attention: str = Attention.AUTO
    block_size: int = SchedulerConfig.block_size
    num_kv_blocks: int | None = None  # KV-cache blocks; None: as many as kv_cache_memory holds
    kv_cache_memory: float = DEFAULT_KV_CACHE_GIB  # GiB, when num_kv_blocks is not given
    num_cpu_blocks: int | None = None  # CPU swap space in blocks (instead of swap_space)
    swap_space: float | None = None  # GiB; None: the device's default (4 with cuda, 0 on CPU)
    threads: int | None = None  # torch CPU threads
    enforce_eager: bool = False  # no CUDA graphs for decode steps (bin/serve --enforce-eager)
    max_model_len: int | None = None  # prompt + output; None: the model's max_position_embeddings
    max_sessions: int = FrontendConfig.max_sessions  # finished requests remembered for continuation
    max_logprobs: int = FrontendConfig.max_logprobs  # the most top log-probabilities a request may ask for
    scheduler: dict[str, Any] = field(default_factory=dict)  # SchedulerConfig knobs by their names

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

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The batcher's config with the least valid pool (ValueError on a bad knob), before
        the runner says how large its pool is (:func:`dataclasses.replace` then)."""
        return SchedulerConfig(
            num_blocks=self.num_kv_blocks or 1,
            num_cpu_blocks=self.num_cpu_blocks or 0,
            block_size=self.block_size,
            max_model_len=max_model_len,
            **self.scheduler,
        )

    def runner_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`conveyor.worker.main.build_runner`, converted as bin/serve
        converts its flags (GiB to bytes)."""
        return dict(
            device=self.device,
            dtype=self.dtype,
            attention=self.attention,
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=None if self.num_kv_blocks else _gib(self.kv_cache_memory),
            num_cpu_blocks=self.num_cpu_blocks,
            swap_space_bytes=None if self.swap_space is None else _gib(self.swap_space),
            num_threads=self.threads,
            max_num_seqs=self.scheduler.get("max_num_seqs", SchedulerConfig.max_num_seqs),
            enforce_eager=self.enforce_eager,
        )


def _gib(gib: float) -> int:
    return int(gib * 2**30)
