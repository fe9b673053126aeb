"""Batched KV block movement: swaps between caches (GPU <-> pinned CPU) and copy-on-write.

Both operations take whole blocks of every layer: for a layer cache
``[2, num_blocks, block_size, kv_heads, head_dim]`` a "block" is ``kv[:, block_id]``, its K and
V halves together.

**Layer stacks.** The worker allocates all layers of a cache as views of one tensor (the GPU
cache layer-major, the CPU swap space block-major: :mod:`conveyor.worker.kv_cache`), so a
list of layers is one strided ``[layers, 2, num_blocks, ...]`` tensor (:func:`stacked`):
every operation below then moves a block of *all* layers in one op. Layers allocated
separately (tests, callers of their own) are handled one layer at a time by the same code.

**Swaps** (:func:`swap_blocks`) move the listed blocks to another cache with the same block
shape, usually on another device. Per layer stack, the device side gathers (swap-out) or
scatters (swap-in) all blocks of all layers in one indexing kernel through a staging buffer
``[blocks, layers, 2, ...]`` on the device, and the host side moves as *runs*: pairs are
ordered by their host block id, and each run of consecutive host ids is one contiguous copy
of ``run * layers`` block pairs between the staging buffer and the host cache (block-major,
so a run is contiguous there), straight to or from its pinned memory: no host-side gather or
scatter, no copy per block and layer. Staging is capped at ``max_staging_bytes`` (the swap is
split into chunks of that many blocks), so a large swap needs no large free GPU region.

**Copy-on-write** (:func:`copy_blocks`) duplicates blocks inside one cache on the device with a
Triton kernel taking ``[N, 2]`` int64 ``(src, dst)`` pairs: one launch moves all pairs of all
layers of a stack.

Invariants the caller (the scheduler's block pool) guarantees: destination ids are distinct, and
in ``copy_blocks`` no destination is also a source (the destinations are freshly allocated
blocks), so the copies of one launch are independent. In ``swap_blocks`` all reads of a chunk
happen before its writes, so overlapping ids within one chunk are harmless.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from conveyor.kernels._common import interpreting, next_pow2

__all__ = ["copy_blocks", "copy_blocks_ref", "stacked", "swap_blocks", "swap_blocks_ref"]

Caches = torch.Tensor | Sequence[torch.Tensor]
BlockIds = torch.Tensor | Sequence[int]

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


def stacked(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[len(layers), *layer.shape]`` view over ``layers`` when they are equally spaced views
    of one storage with equal shapes and strides (how the worker allocates them); else None."""
    first = layers[0]
    if len(layers) == 1:
        return first.unsqueeze(0)
    step = layers[1].data_ptr() - first.data_ptr()
    size = first.element_size()
    if step <= 0 or step % size:
        return None
    storage = first.untyped_storage().data_ptr()
    for i, layer in enumerate(layers):
        if (
            layer.shape != first.shape
            or layer.stride() != first.stride()
            or layer.dtype != first.dtype
            or layer.device != first.device
            or layer.untyped_storage().data_ptr() != storage
            or layer.data_ptr() != first.data_ptr() + i * step
        ):
            return None
    return first.as_strided((len(layers), *first.shape), (step // size, *first.stride()))


def _stacks(*caches: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Aligned layer stacks of each cache: one stack each when every cache stacks, else one
    per layer (``layer.unsqueeze(0)``)."""
    whole = [stacked(layers) for layers in caches]
    if all(stack is not None for stack in whole):
        return [tuple(whole)]
    return [tuple(layers[i].unsqueeze(0) for layers in caches) for i in range(len(caches[0]))]


def _by_block(stack: torch.Tensor) -> torch.Tensor:
    """``[L, 2, N, ...]`` -> ``[N, L, 2, ...]`` (a view): indexing dim 0 takes whole blocks."""
    return stack.movedim(2, 0)


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    pairs_ptr,
    stride_layer,
    stride_kv,
    stride_block,
    block_elems,
    BLOCK: tl.constexpr,
):
    """Grid (pairs, layers * 2 halves, chunks): copy one BLOCK-element chunk of one half of one
    block of one layer; ``cache_ptr`` is layer 0, layer ``l`` starts ``l * stride_layer`` later."""
    pair = tl.program_id(0)
    layer_half = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_elems
    layer = (layer_half // 2).to(tl.int64)
    half = (layer_half % 2).to(tl.int64)
    base = cache_ptr + layer * stride_layer + half * stride_kv
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)


def copy_blocks(caches: Caches, block_pairs: torch.Tensor) -> None:
    """Copy blocks within each layer cache in place: ``kv[:, dst] = kv[:, src]`` for each row
    ``(src, dst)`` of ``block_pairs`` (``[N, 2]`` int64).

    On CUDA (or under the Triton interpreter) one Triton launch per layer stack (all layers of
    a worker's cache); on a plain CPU cache, the same copy with torch indexing.
    """
    layers = _as_layers(caches)
    if block_pairs.dim() != 2 or block_pairs.shape[1] != 2:
        raise ValueError(f"block_pairs must be [N, 2], got {tuple(block_pairs.shape)}")
    if block_pairs.shape[0] == 0 or not layers:
        return
    pairs = block_pairs.to(device=layers[0].device, dtype=torch.int64, non_blocking=True).contiguous()
    for (stack,) in _stacks(layers):
        if stack.is_cuda or interpreting():
            _launch_copy_blocks(stack[0], pairs, stack.shape[0], stack.stride(0))
        else:
            blocks = _by_block(stack)
            blocks[pairs[:, 1]] = blocks[pairs[:, 0]]


def _launch_copy_blocks(kv: torch.Tensor, pairs: torch.Tensor, num_layers: int = 1, stride_layer: int = 0) -> None:
    """One launch for all pairs of ``num_layers`` layers, the first ``kv``, each ``stride_layer``
    elements after the previous; ``pairs`` contiguous int64 on ``kv``'s device."""
    block_elems = kv[0, 0].numel()
    block = min(4096, next_pow2(block_elems))
    grid = (pairs.shape[0], 2 * num_layers, triton.cdiv(block_elems, block))
    _copy_blocks_kernel[grid](
        kv, pairs, stride_layer, kv.stride(0), kv.stride(1), block_elems, BLOCK=block, num_warps=4
    )


def _host_ids(ids: BlockIds) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        return ids.detach().to("cpu", torch.int64).numpy()
    return np.asarray(list(ids), dtype=np.int64)


def swap_blocks(
    src_caches: Caches,
    dst_caches: Caches,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
    wait: bool = True,
) -> None:
    """Copy block ``src_block_ids[i]`` of every source layer to block ``dst_block_ids[i]`` of the
    matching destination layer, across devices in as few transfers as the staging cap allows.

    Layers pair up in order and must agree in dtype and block shape (``kv.shape[2:]``); the two
    sides may differ in ``num_blocks`` and device. Copies are queued on the current stream.
    When the destination is host memory and ``wait`` is set, the call returns after the data
    has landed there; the worker passes ``wait=False``, since only later copies on the same
    stream ever read its swap space.
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
    src_ids, dst_ids = _host_ids(src_block_ids), _host_ids(dst_block_ids)
    if src_ids.shape != dst_ids.shape or src_ids.ndim != 1:
        raise ValueError("src_block_ids and dst_block_ids must be 1-D and of equal length")
    if len(src_ids) == 0:
        return
    _swap_staged(src_layers, dst_layers, src_ids, dst_ids, max_staging_bytes)
    if wait and dst_dev.type == "cpu" and src_dev.type == "cuda":
        torch.cuda.current_stream(src_dev).synchronize()


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges of ``ids`` whose values go up by one."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    edges = [0, *breaks.tolist(), len(ids)]
    return list(zip(edges[:-1], edges[1:]))


def _swap_staged(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_ids: BlockIds,
    dst_ids: BlockIds,
    max_staging_bytes: int,
) -> None:
    """The body of :func:`swap_blocks` (see the module docstring), chunked by the staging cap.

    The host side (the destination of a swap-out, the source of a swap-in; the destination
    within one device) moves in runs of consecutive block ids, the other side through one
    indexing op per chunk and layer stack.
    """
    src_ids, dst_ids = _host_ids(src_ids), _host_ids(dst_ids)
    src_dev, dst_dev = src_layers[0].device, dst_layers[0].device
    from_host = src_dev.type == "cpu" and dst_dev.type != "cpu"
    order = np.argsort(src_ids if from_host else dst_ids, kind="stable")
    src_ids, dst_ids = src_ids[order], dst_ids[order]
    per_block = 2 * src_layers[0][0, 0].numel() * src_layers[0].element_size() * len(src_layers)
    chunk = max(1, min(len(src_ids), max_staging_bytes // per_block))
    for lo in range(0, len(src_ids), chunk):
        src_chunk, dst_chunk = src_ids[lo : lo + chunk], dst_ids[lo : lo + chunk]
        for src_stack, dst_stack in _stacks(src_layers, dst_layers):
            _swap_chunk(_by_block(src_stack), _by_block(dst_stack), src_chunk, dst_chunk, from_host)


def _swap_chunk(
    src: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray, from_host: bool
) -> None:
    """Move blocks ``src[src_ids]`` to ``dst[dst_ids]`` (``[N, L, 2, ...]`` block-major views).
    ``from_host``: ``src_ids`` ascend in runs, copied straight into a device staging buffer;
    otherwise ``dst_ids`` do, and the source side is gathered in one op."""
    if from_host:
        staged = torch.empty((len(src_ids), *src.shape[1:]), dtype=src.dtype, device=dst.device)
        for start, end in _runs(src_ids):
            first = int(src_ids[start])
            staged[start:end].copy_(src[first : first + end - start], non_blocking=True)
        dst[torch.from_numpy(dst_ids).to(dst.device, non_blocking=True)] = staged
        return
    staged = src[torch.from_numpy(src_ids).to(src.device, non_blocking=True)]
    if staged.device != dst.device:
        for start, end in _runs(dst_ids):
            first = int(dst_ids[start])
            dst[first : first + end - start].copy_(staged[start:end], non_blocking=True)
    else:
        dst[torch.from_numpy(dst_ids).to(dst.device)] = staged


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
