"""Batched KV block copies between the GPU cache and the CPU swap space: the worker's half of
swapping; and copies inside the GPU cache (``StepPlan.copy_blocks``: a forked sequence's own copy
of its prompt's partly filled last block).

The scheduler decides which blocks move (``StepPlan.swap_out`` / ``swap_in``, pairs of
``[src, dst]`` block ids); this module only moves them, through
:func:`conveyor.kernels.block_copy.swap_blocks`: per chunk one gather or scatter of the blocks
of all layers on the device, and one copy per run of consecutive host block ids between a
device staging buffer and the pinned, block-major swap space (see :mod:`.kv_cache`), not one
copy per block and layer.

Invariants the plan guarantees (see ``StepPlan``): destinations within one call are
distinct, and the runner calls swap-outs, then swap-ins, then :func:`copy_blocks`, all
before the forward. All copies are queued on the current stream, in call order, so a swap-in
reads what an earlier swap-out wrote, a block swapped out is read before a later op (a fork's
copy included) overwrites it, and a fork's copy reads a block swapped in before it; nothing
here waits for the device (the host never reads the swap space itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def transfer_blocks(
    src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor], pairs: Sequence[Sequence[int]]
) -> None:
    """Copy block ``src`` of every layer of ``src_layers`` into block ``dst`` of ``dst_layers``, for each pair.

    Layer caches are ``[2, num_blocks, block_size, kv_heads, head_dim]``; a block is
    ``layer[:, block]`` (keys and values together). Source and destination may live on
    different devices (GPU and pinned CPU memory).
    """
    if not pairs:
        return
    # Imported on first use, like the attention kernels: importing a kernel module decorates
    # Triton functions, which must wait until TRITON_INTERPRET is settled (tests).
    from conveyor.kernels.block_copy import swap_blocks

    swap_blocks(src_layers, dst_layers, [p[0] for p in pairs], [p[1] for p in pairs], wait=False)


def copy_blocks(layers: Sequence[torch.Tensor], pairs: torch.Tensor) -> None:
    """``kv[:, dst] = kv[:, src]`` in every layer for each ``[src, dst]`` row of ``pairs``
    (``[N, 2]`` int64; destinations distinct and never sources: see ``StepPlan``)."""
    from conveyor.kernels.block_copy import copy_blocks as copy_kernel

    copy_kernel(layers, pairs)
