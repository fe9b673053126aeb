"""How a model splits over tensor-parallel ranks: which rank a worker is, how many items of a
dimension it holds, which attention heads it computes. Imports no torch, so bin/serve can
refuse a model (the served one or a speculative draft) whose heads or MLP features cannot be
split, before any process starts or any weight loads (:func:`check_shardable`); the worker's
model and KV cache build their shards with the very same functions
(:mod:`conveyor.worker.parallel` re-exports them beside the collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.checkpoints.model_config import ModelConfig

if TYPE_CHECKING:  # the process group is the worker's; only its type is named here
    import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This worker's place in the tensor-parallel group: rank ``rank`` of ``size``.

    Invariant: ``0 <= rank < size``; ``group`` is the process group the collectives run on
    (``None`` at size 1, where there is none, and in tests that only build shards).
    ``expert_parallel``: a mixture-of-experts model's ranks each hold ``1/size`` of the experts
    whole rather than ``1/size`` of every expert's features (:func:`shard_experts`).
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside 0..{self.size - 1}")

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` items split evenly; ValueError naming ``what`` if
        ``total`` does not divide by the size."""
        if total % self.size:
            raise ValueError(f"{what} {total} does not divide by the tensor-parallel size {self.size}")
        return total // self.size

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """The ``[start, end)`` range of ``total`` items this rank holds (see :meth:`split`)."""
        share = self.split(total, what)
        return self.rank * share, (self.rank + 1) * share


NO_TENSOR_PARALLEL = TensorParallel()


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: checkpoint query heads ``q_start ..
    q_start + num_heads - 1`` and kv heads ``kv_start .. kv_start + num_kv_heads - 1``.

    Invariant: every query head of the rank attends to a kv head of the rank, as in the
    unsplit model (query head ``h`` uses kv head ``h // (total heads / total kv heads)``).
    """

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def shard_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """Split ``num_heads`` query heads evenly over the ranks, with their kv heads.

    With at least as many kv heads as ranks, each rank takes an even share of them. With
    fewer, each rank holds the one kv head its query heads use, so a kv head is replicated on
    ``size / num_kv_heads`` ranks (its projection rows are loaded, and its cache kept, on each
    of them). Refused (ValueError) when the heads cannot be split that way.
    """
    local_heads = tp.split(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        local_kv = tp.split(num_kv_heads, "num_key_value_heads")
        return HeadShard(local_heads, local_kv, tp.rank * local_heads, tp.rank * local_kv)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads {num_kv_heads} is fewer than the tensor-parallel size {tp.size} "
            "and does not divide it, so kv heads cannot be replicated evenly"
        )
    ranks_per_kv_head = tp.size // num_kv_heads
    return HeadShard(local_heads, 1, tp.rank * local_heads, tp.rank // ranks_per_kv_head)


@dataclass(frozen=True)
class ExpertShard:
    """The experts one rank holds: checkpoint experts ``first .. first + count - 1``, each
    with its intermediate features ``features[0] .. features[1] - 1``."""

    first: int
    count: int
    features: tuple[int, int]


def shard_experts(num_experts: int, intermediate_size: int, tp: TensorParallel) -> ExpertShard:
    """Tensor-sliced (default): every expert on every rank, each rank its share of every
    expert's features. Expert-parallel (``tp.expert_parallel``): each rank ``num_experts /
    size`` whole experts. ValueError naming what does not divide."""
    if tp.expert_parallel:
        count = tp.split(num_experts, "num_experts")
        return ExpertShard(tp.rank * count, count, (0, intermediate_size))
    return ExpertShard(0, num_experts, tp.shard(intermediate_size, "moe intermediate_size"))


def check_shardable(config: ModelConfig, size: int, source: str, expert_parallel: bool = False) -> None:
    """ValueError, naming ``source`` (the flag and directory it came from), unless ``config``'s
    heads (:func:`shard_heads`), MLP features and experts (:func:`shard_experts`) split over
    ``size`` ranks as every rank's shard needs. Whether they do does not depend on the rank, so
    rank 0's split decides."""
    tp = TensorParallel(0, size, expert_parallel=expert_parallel)
    try:
        shard_heads(config.num_heads, config.num_kv_heads, tp)
        moe = config.moe
        if moe is None or not all(moe.sparse_layers):
            tp.split(config.intermediate_size, "intermediate_size")
        if moe is not None:
            shard_experts(moe.num_experts, moe.intermediate_size, tp)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
