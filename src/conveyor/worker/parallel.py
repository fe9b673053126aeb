"""Tensor parallelism on torch.distributed: which rank this worker is, which part of the
model it holds, and the collectives the model calls.

The model is split Megatron-style across ``N`` ranks (one process each): q/k/v and gate/up
projections column-parallel (each rank computes its attention heads and its slice of the MLP's
intermediate features), o and down projections row-parallel (each rank multiplies its input
slice; one all-reduce sums the partial products). That is two all-reduces per layer and no
other collective in the forward. Embedding, final norm and LM head are replicated, and only
rank 0 runs the LM head and samples: the sampler (top-k/top-p/seeded draws) then needs full
logits on one rank, which a vocab-parallel head would have to gather there anyway, and the
other ranks skip the head's matmul and, for untied checkpoints, its weights. Rank 0 then
broadcasts the sampled ids, the one extra collective per step: the next step's decode inputs
are those ids, and every rank embeds them. Size 1 is exactly the unsplit model: no process
group, every collective a no-op.

**Interface for the process side** (one worker process per rank):

- Each rank calls :func:`init_tensor_parallel` once (``rank``, ``size``, a shared
  ``init_method`` such as ``file:///tmp/x`` or ``tcp://127.0.0.1:port``, backend ``gloo`` on
  CPU or ``nccl`` on CUDA: :func:`default_backend`; ``timeout_s`` bounds every collective) and
  passes the record to ``ModelRunner(config, tensor_parallel=tp)`` (``config.device`` the
  rank's). With NCCL, rank ``r`` runs on ``cuda:r`` (:func:`rank_device` gives the device
  string; :func:`conveyor.worker.main.build_runner` sets it).
- Every rank is given the same plans in the same order and makes the same ``launch`` /
  ``finish`` calls: each step runs the same collectives on every rank.
- **Results**: every rank's ``finish`` returns the same :class:`StepResult` (slots and sampled
  ids: rank 0's ids, broadcast), so every rank's request state stays identical to rank 0's.
  The process side sends rank 0's result and drops the others'.
- **Errors**: a plan the runner refuses (ValueError from validation, including one planned
  ahead of a failed step) is refused identically on every rank before any collective, so the
  group stays in step and the error is reported like today. Any other exception on any rank
  (a device error; a collective that timed out or broke because a peer died) leaves the
  group out of step: stop every rank. A rank blocked in a collective whose peer is gone
  raises within ``timeout_s`` (gloo; NCCL's watchdog aborts the process), never hangs.
- **KV capacity** is per rank: a rank caches only its own KV heads
  (:attr:`HeadShard.num_kv_heads`), and ``ModelRunner.num_blocks`` is what its share of
  ``kv_cache_memory_bytes`` holds (``KVCacheShape.of(..., tensor_parallel=tp).bytes_per_block``).
  Ranks must agree on the pool the scheduler plans with: take the minimum across ranks (block
  ids below it are valid on every rank). Swap-ins, swap-outs and block copies run on every
  rank, each on its own heads.
- At exit, :func:`close_tensor_parallel`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# The group's arithmetic is torch-free (bin/serve checks that a model splits before any process
# starts); the model and its cache import it from here, beside the collectives.
from conveyor.runtime.tensor_shards import NO_TENSOR_PARALLEL, ExpertShard, HeadShard, TensorParallel, shard_experts, shard_heads  # noqa: F401


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
