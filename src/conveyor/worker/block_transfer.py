"""Batched KV block copies between the GPU cache and the CPU swap space: the worker's half of swapping.

The scheduler decides which blocks move (``StepPlan.swap_out`` / ``swap_in``, pairs of
``[src, dst]`` block ids); this module only moves them. All pairs of one direction move
together: per layer one gather of the source blocks (``index_select``), one transfer of the
gathered tensor across the bus, one scatter into the destinations (``index_copy_``),
instead of ``2 * layers * blocks`` small copies that would each pay launch and DMA setup.

:func:`transfer_blocks` is the one call site; a fused kernel (``kernels/block_copy.py``,
which also stages through pinned memory) can replace its body without touching the runner.

Invariants the plan guarantees (see ``StepPlan``): destinations within one call are
distinct, and the runner calls swap-outs before swap-ins, both before the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def transfer_blocks(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor], pairs: Sequence[Sequence[int]]) -> None:
    """Copy block ``src`` of every layer of ``src_layers`` into block ``dst`` of ``dst_layers``, for each pair.

    Layer caches are ``[2, num_blocks, block_size, kv_heads, head_dim]``; a block is
    ``layer[:, block]`` (keys and values together). Source and destination may live on
    different devices (GPU and pinned CPU memory).
    """
    if not pairs:
        return
    src_ids = [p[0] for p in pairs]
    dst_ids = [p[1] for p in pairs]
    src_device = src_layers[0].device
    dst_device = dst_layers[0].device
    src_index = torch.tensor(src_ids, dtype=torch.int64).to(src_device, non_blocking=True)
    dst_index = torch.tensor(dst_ids, dtype=torch.int64).to(dst_device, non_blocking=True)
    # A device -> host copy into pageable memory is synchronous; host -> device from the CPU
    # gather is ordered before the forward on the same stream, so neither needs a sync here.
    for src, dst in zip(src_layers, dst_layers):
        gathered = src.index_select(1, src_index)
        if gathered.device != dst_device:
            gathered = gathered.to(dst_device, non_blocking=dst_device.type == "cuda")
        dst.index_copy_(1, dst_index, gathered)
