"""Batched KV block movement: swaps between caches (GPU <-> pinned CPU) and copy-on-write.

Both operations take whole blocks of every layer: for a layer cache
``[2, num_blocks, block_size, kv_heads, head_dim]`` a "block" is ``kv[:, block_id]``, its K and
V halves together.

**Swaps** (:func:`swap_blocks`) move the listed blocks from one set of layer caches to another
with the same block shape, usually on another device. Copying block by block would issue
``2 * layers * blocks`` small ``cudaMemcpy`` calls, each paying a few microseconds of launch and
DMA setup for a few KiB of data, so instead the blocks of all layers are gathered with
``index_select`` into one contiguous staging buffer on the source device (one bandwidth-bound
kernel per layer, or CPU memcpy into pinned memory), the whole buffer crosses the bus in one
transfer, and ``index_copy_`` scatters it into the destination. Staging is capped at
``max_staging_bytes`` (the swap is split into that many block chunks), so a large swap does not
need a large free GPU region. A torch gather/scatter is used rather than a Triton kernel because
one side lives in host memory, which a GPU kernel would have to reach through slow zero-copy
mapped accesses; the device-side gather is already a single bandwidth-bound kernel.

**Copy-on-write** (:func:`copy_blocks`) duplicates blocks inside one cache on the device with a
Triton kernel taking ``[N, 2]`` int64 ``(src, dst)`` pairs: one launch per layer moves all pairs.

Invariants the caller (the scheduler's block pool) guarantees: destination ids are distinct, and
in ``copy_blocks`` no destination is also a source (the destinations are freshly allocated
blocks), so the copies of one launch are independent. In ``swap_blocks`` all reads happen before
any write, so overlapping ids within one chunk are harmless.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import interpreting, next_pow2

__all__ = ["copy_blocks", "copy_blocks_ref", "swap_blocks", "swap_blocks_ref"]

Caches = Union[torch.Tensor, Sequence[torch.Tensor]]
BlockIds = Union[torch.Tensor, Sequence[int]]

#: Default cap on one swap chunk's staging buffer (per side).
DEFAULT_MAX_STAGING_BYTES = 256 << 20


def _as_layers(caches: Caches) -> list[torch.Tensor]:
    layers = [caches] if isinstance(caches, torch.Tensor) else list(caches)
    for kv in layers:
        if kv.dim() < 2 or kv.shape[0] != 2:
            raise ValueError(f"a layer cache must be [2, num_blocks, ...], got {tuple(kv.shape)}")
        if not kv[0, 0].is_contiguous():
            raise ValueError("each block of a layer cache must be contiguous")
    return layers


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    pairs_ptr,
    stride_kv,
    stride_block,
    block_elems,
    BLOCK: tl.constexpr,
):
    """Grid (pairs, 2 halves, chunks): copy one BLOCK-element chunk of one half of one block."""
    pair = tl.program_id(0)
    half = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_elems
    base = cache_ptr + half.to(tl.int64) * stride_kv
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)


def copy_blocks(caches: Caches, block_pairs: torch.Tensor) -> None:
    """Copy blocks within each layer cache in place: ``kv[:, dst] = kv[:, src]`` for each row
    ``(src, dst)`` of ``block_pairs`` (``[N, 2]`` int64, on the caches' device).

    On CUDA (or under the Triton interpreter) one Triton launch per layer; on a plain CPU cache,
    the same copy with torch indexing.
    """
    layers = _as_layers(caches)
    if block_pairs.dim() != 2 or block_pairs.shape[1] != 2:
        raise ValueError(f"block_pairs must be [N, 2], got {tuple(block_pairs.shape)}")
    if block_pairs.shape[0] == 0 or not layers:
        return
    pairs = block_pairs.to(dtype=torch.int64).contiguous()
    for kv in layers:
        if pairs.device != kv.device:
            pairs = pairs.to(kv.device)
        if kv.is_cuda or interpreting():
            _launch_copy_blocks(kv, pairs)
        else:
            kv[:, pairs[:, 1]] = kv[:, pairs[:, 0]]


def _launch_copy_blocks(kv: torch.Tensor, pairs: torch.Tensor) -> None:
    """One launch for all pairs of one layer; ``pairs`` contiguous int64 on ``kv``'s device."""
    block_elems = kv[0, 0].numel()
    block = min(4096, next_pow2(block_elems))
    grid = (pairs.shape[0], 2, triton.cdiv(block_elems, block))
    _copy_blocks_kernel[grid](kv, pairs, kv.stride(0), kv.stride(1), block_elems, BLOCK=block, num_warps=4)


def _index_tensor(ids: BlockIds, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.int64)
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


def swap_blocks(
    src_caches: Caches,
    dst_caches: Caches,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
) -> None:
    """Copy block ``src_block_ids[i]`` of every source layer to block ``dst_block_ids[i]`` of the
    matching destination layer, across devices in as few transfers as the staging cap allows.

    Layers pair up in order and must agree in dtype and block shape (``kv.shape[2:]``); the two
    sides may differ in ``num_blocks`` and device. When the destination is host memory the call
    returns after the data has landed there; a host-to-device swap is queued on the current
    stream (its pinned staging buffer stays reserved until the copy completes).
    """
    src_layers = _as_layers(src_caches)
    dst_layers = _as_layers(dst_caches)
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers but {len(dst_layers)} destination layers")
    if not src_layers:
        return
    src_dev, dst_dev = src_layers[0].device, dst_layers[0].device
    for s, d in zip(src_layers, dst_layers):
        if s.dtype != d.dtype or s.shape[2:] != d.shape[2:]:
            raise ValueError("source and destination layers must share dtype and block shape")
        if s.device != src_dev or d.device != dst_dev:
            raise ValueError("all source layers must share one device, and all destinations another")
    src_idx = _index_tensor(src_block_ids, src_dev)
    dst_idx = _index_tensor(dst_block_ids, dst_dev)
    if src_idx.shape != dst_idx.shape or src_idx.dim() != 1:
        raise ValueError("src_block_ids and dst_block_ids must be 1-D and of equal length")
    n = src_idx.shape[0]
    if n == 0:
        return

    if src_dev == dst_dev:
        # Same device: gather then scatter per layer, no staging across layers needed.
        for s, d in zip(src_layers, dst_layers):
            d.index_copy_(1, dst_idx, s.index_select(1, src_idx))
        return
    _swap_staged(src_layers, dst_layers, src_idx, dst_idx, max_staging_bytes)


def _swap_staged(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    max_staging_bytes: int,
) -> None:
    """The cross-device path of :func:`swap_blocks` (also correct, if pointless, within one
    device, which is how CPU-only tests exercise its chunking)."""
    src_dev, dst_dev = src_layers[0].device, dst_layers[0].device
    n = src_idx.shape[0]
    block_shape = tuple(src_layers[0].shape[2:])
    layer_block_bytes = 2 * src_layers[0][0, 0].numel() * src_layers[0].element_size()
    per_block = layer_block_bytes * len(src_layers)
    chunk = max(1, min(n, max_staging_bytes // per_block))
    pin = torch.cuda.is_available()
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        stage_shape = (len(src_layers), 2, hi - lo) + block_shape
        staged = torch.empty(
            stage_shape,
            dtype=src_layers[0].dtype,
            device=src_dev,
            pin_memory=pin and src_dev.type == "cpu",
        )
        for i, s in enumerate(src_layers):
            torch.index_select(s, 1, src_idx[lo:hi], out=staged[i])
        if dst_dev.type == "cpu":
            # Device -> host: land in pinned memory at full DMA speed, and block until it has
            # arrived, because the scatter below runs on the host right away.
            landed = torch.empty(stage_shape, dtype=staged.dtype, pin_memory=pin)
            landed.copy_(staged, non_blocking=False)
        else:
            landed = staged.to(dst_dev, non_blocking=True)
        for i, d in enumerate(dst_layers):
            d.index_copy_(1, dst_idx[lo:hi], landed[i])


def swap_blocks_ref(
    src_caches: Caches, dst_caches: Caches, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
) -> list[torch.Tensor]:
    """Reference: new copies of the destination layers with each listed block copied, one by one."""
    out = [d.detach().clone() for d in _as_layers(dst_caches)]
    for s, d in zip(_as_layers(src_caches), out):
        for si, di in zip(list(src_block_ids), list(dst_block_ids)):
            d[:, int(di)] = s[:, int(si)].to(d.device)
    return out


def copy_blocks_ref(caches: Caches, block_pairs: torch.Tensor) -> list[torch.Tensor]:
    """Reference: new copies of the layers with each ``(src, dst)`` pair copied, one by one."""
    out = [kv.detach().clone() for kv in _as_layers(caches)]
    for kv in out:
        for src, dst in block_pairs.tolist():
            kv[:, dst] = kv[:, src]
    return out
