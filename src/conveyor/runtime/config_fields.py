"""Checked fields of the frozen configs (:mod:`conveyor.runtime.config`, which re-exports the
modes): the modes bin/serve's flags name (:class:`Choice` enums), their parsing, and the
numeric bounds. A mode member compares equal to (and hashes as) its name on the command line,
so ``config.policy == "priority"`` reads as it always did, and a config built with a plain
string holds the member after construction (an unknown name is a ValueError). Imports nothing
heavy: the frontend and the scheduler load it.
"""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """A mode named on the command line; prints and formats as that name."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def names(cls) -> list[str]:
        """The names a flag accepts, in declaration order (argparse ``choices``)."""
        return [member.value for member in cls]

    @classmethod
    def parse(cls, value: str, what: str) -> Choice:
        """The member named ``value``; a ValueError naming ``what`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {', '.join(cls.names())}, got {value!r}") from None


class Batching(Choice):
    CONTINUOUS = "continuous"  # iteration-level batching
    STATIC = "static"  # form a batch, run it to completion: the baseline benchmarks compare against


class Policy(Choice):
    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # AddRequest.priority, aged; preempts lower-ranked running requests


class Preemption(Choice):
    AUTO = "auto"  # the cheaper of swap and recompute, per victim
    SWAP = "swap"  # KV to the CPU swap space
    RECOMPUTE = "recompute"  # KV dropped, prefilled again


class PlanTransport(Choice):
    SHM = "shm"  # shared-memory rings
    ZMQ = "zmq"  # ZeroMQ ipc sockets


class Device(Choice):
    AUTO = "auto"  # cuda when available
    CPU = "cpu"
    CUDA = "cuda"


class Dtype(Choice):
    AUTO = "auto"  # the checkpoint's on CUDA, float32 on CPU
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Quantization(Choice):
    """How the weights are held (conveyor.worker.quantization; docs/quantization.md)."""

    AUTO = "auto"  # a GPTQ/AWQ/compressed-tensors checkpoint kept quantized, any other (GGUF too) float
    GGUF = "gguf"  # a block-quantized GGUF file kept quantized (its greedy agreement: docs/quantization.md)
    NONE = "none"  # float weights (a GGUF file dequantized at load)
    INT8 = "int8"  # int8 per channel, quantized at load
    INT4 = "int4"  # int4 in groups of 32, quantized at load
    FP8 = "fp8"  # e4m3 per channel, quantized at load


class Attention(Choice):
    AUTO = "auto"  # Triton on CUDA, batched torch on CPU
    TRITON = "triton"
    TORCH = "torch"
    TORCH_REF = "torch-ref"  # the per-sequence torch reference (slow, for comparisons)


class KVCacheDtype(Choice):
    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # float8_e4m3fn, one static scale per layer for keys and one for values
    INT8 = "int8"  # int8, likewise


class PipelineSteps(Choice):
    AUTO = "auto"  # on with CUDA, off on CPU
    ON = "on"
    OFF = "off"


def parse_choices(config: object, **kinds: type[Choice]) -> None:
    """Turn the named fields of a frozen dataclass into their Choice members, in place."""
    for name, kind in kinds.items():
        object.__setattr__(config, name, kind.parse(getattr(config, name), name))


def require_at_least(config: object, low: int, *names: str) -> None:
    """ValueError naming the first of the fields ``names`` of ``config`` below ``low`` (a NaN
    is below anything): one wording for every such bound, "positive" for 1, ">= 0" for 0."""
    bound = {0: ">= 0", 1: "positive"}.get(low, f"at least {low}")
    for name in names:
        value = getattr(config, name)
        if not value >= low:
            raise ValueError(f"{name} must be {bound}, got {value}")
