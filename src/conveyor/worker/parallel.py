"""Tensor parallelism on torch.distributed: which rank this worker is, which part of the
model it holds, and the collectives the model calls.

Megatron-style: q/k/v and gate/up column-parallel, o and down row-parallel (two all-reduces
per layer); only rank 0 runs the LM head and samples, then broadcasts the ids. Size 1 is the
unsplit model, every collective a no-op (docs/architecture.md, "Tensor parallelism: the
contract of a rank").
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# The group's arithmetic is torch-free (bin/serve checks that a model splits before any process
# starts); the model and its cache import it from here, beside the collectives.
from conveyor.runtime.tensor_shards import (
    NO_TENSOR_PARALLEL,  # noqa: F401  (re-exported, as the other names below)
    ExpertShard,  # noqa: F401
    HeadShard,  # noqa: F401
    TensorParallel,
    shard_experts,  # noqa: F401
    shard_heads,  # noqa: F401
)


def default_backend(device: str) -> str:
    """The torch.distributed backend for ranks on ``device``: NCCL between GPUs, gloo on CPU."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, tp: TensorParallel, first_device: int = 0) -> str:
    """The device rank ``tp.rank`` runs on: on CUDA, GPU ``first_device + rank`` (one GPU per
    rank; data-parallel replica i starts at ``i * size``), wrapped around the GPUs the machine
    has, so replicas share them when there are fewer GPUs than ranks in all; ``device``
    otherwise."""
    if not str(device).startswith("cuda"):
        return str(device)
    return f"cuda:{(first_device + tp.rank) % max(torch.cuda.device_count(), 1)}"


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str,
    backend: str,
    timeout_s: float,
    device: str | None = None,
    expert_parallel: bool = False,
) -> TensorParallel:
    """Join the ``size``-rank group as ``rank`` and return its record; every rank must call
    this with the same ``init_method``, ``backend`` and ``size``. Blocks until all have joined
    (or ``timeout_s`` passes: RuntimeError saying so, e.g. when a node never started). Size 1
    creates no process group. ``init_method`` is a ``file://`` in the run directory on one
    node, ``tcp://`` ``--dist-init-addr`` across nodes (rank 0 hosts the store).

    ``timeout_s`` bounds every later collective too, so a rank whose peer died raises instead
    of waiting forever. With ``nccl`` (a CUDA device, at any size, 1 too), the rank's device
    (``device``, by default ``cuda:<rank>``; see :func:`rank_device`) is made current here, the
    one place a worker selects its GPU: Triton launches on the current device, so a
    data-parallel replica on cuda:1 that skipped this would run its kernels on cuda:0.
    ``expert_parallel``: the record's (a mixture-of-experts model's split, not the group's).
    """
    device_id = None
    if backend == "nccl":
        device_id = torch.device(device or f"cuda:{rank}")
        torch.cuda.set_device(device_id)
    if size == 1:
        return TensorParallel(rank, 1, None, expert_parallel)
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device_id,
        )
    except (RuntimeError, ValueError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
        raise RuntimeError(
            f"rank {rank}: the {size} tensor-parallel ranks did not all join at {init_method} within {timeout_s:g} s "
            f"(a node that never started or cannot reach it?): {exc}"
        ) from exc
    return TensorParallel(rank, size, dist.group.WORLD, expert_parallel)


def close_tensor_parallel(tp: TensorParallel) -> None:
    """Leave the group (no-op at size 1)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum ``tensor`` in place across the ranks (a row-parallel layer's partial products);
    returns it. No-op at size 1."""
    if tp.size > 1:
        dist.all_reduce(tensor, group=tp.group)
    return tensor


def all_ranks_agree(ok: bool, tp: TensorParallel, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (an all-reduce MIN; every rank must call it at the
    same point of its work). ``ok`` itself at size 1."""
    if tp.size == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tp.group)
    return bool(flag.item())


def broadcast_from_first_(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank 0's (its sampled ids); returns it.
    No-op at size 1."""
    if tp.size > 1:
        dist.broadcast(tensor, group=tp.group, group_src=0)
    return tensor
