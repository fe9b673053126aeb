"""Batched LoRA deltas (the SGMV idea): many adapters over one step's tokens in two launches.

A fused projection's adapters live stacked per slot, ``a`` ``[slots, R, in]`` and ``b``
``[slots, out, R]`` (``R = pieces * rank``: q/k/v or gate/up stack their ``A`` along the rank
and piece ``p`` of the output, columns ``columns[p]``, reads only rank rows ``p*rank ..
p*rank + rank``). Each token ``t`` with slot ``s`` gets ``y[t] += B_s (A_s x[t])``; a token of
slot -1 (the base model) gets nothing.

**Segments.** The host sorts the adapter tokens by slot (:func:`segment_tiles`): ``tokens``
lists token indices slot by slot, and every segment is cut into tiles of at most ``block``
tokens, ``tiles[i] = (start, end, slot)`` into ``tokens``. A tile has one slot, so one program
loads one adapter's weights for up to ``block`` tokens (a tensor-core dot), and a token is in
exactly one tile, so no two programs write the same row. Tokens need not be contiguous per
adapter in the batch: they are gathered through ``tokens``, so the worker's plan order stays.

- :func:`lora_shrink`: ``A_s x[tokens[i]]`` as float32 partial sums ``[splits, n, R]``, grid
  tiles x splits of the input dimension (a decode step has a tile or two per adapter, too few
  programs for a long input alone). The expand adds the partials up, so there is no atomic,
  no zeroed buffer (one launch less) and the sum's order is fixed.
- :func:`lora_expand`: ``y[tokens[i], columns[p]] += B_s[columns[p], piece p's ranks]
  shrunk[i, piece p's ranks]``, grid tiles x column tiles x pieces; ``shrunk`` is rounded to the
  weights' dtype before the dot (as an unfused ``B(A x)`` rounds), accumulation is float32, and
  ``y`` is rounded once.

Every launch reads its layout from device tensors and its grid depends only on the tile count
and the shapes, never on a value that only the device knows: no host sync.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from conveyor.kernels._common import SUPPORTED_DTYPES, cdiv, next_pow2, tile_dot, upcast_dots

__all__ = ["lora_delta_ref", "lora_expand", "lora_shrink", "segment_tiles", "tile_tokens"]

#: Rank rows and tokens of a tile are at least 16 (``tl.dot``'s smallest extent).
MIN_DOT = 16
#: Programs a shrink aims for before it splits the input dimension (about an H100's SMs).
TARGET_PROGRAMS = 128
#: Most partial sums of a shrink (each one a float32 [n, R] the expand reads).
MAX_SPLITS = 16


def tile_tokens(num_tokens: int) -> int:
    """Tokens per tile: 16 for decode-sized batches (one tile per adapter), 64 for prefill
    (fewer re-reads of each adapter's weights)."""
    return MIN_DOT if num_tokens <= 256 else 64


def segment_tiles(token_slots: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, tiles)`` int32 of ``token_slots`` (slot per token, -1: none): ``tokens`` the
    indices of the adapter tokens, stably sorted by slot; ``tiles`` ``[n, 3]`` rows ``(start,
    end, slot)``, each at most ``block`` tokens of one slot. Both empty when no token has one."""
    order = np.argsort(token_slots, kind="stable")
    ordered = token_slots[order]
    first = int(np.searchsorted(ordered, 0))
    tokens, ordered = order[first:], ordered[first:]
    present, starts, counts = np.unique(ordered, return_index=True, return_counts=True)
    per_segment = -(-counts // block)
    segment = np.repeat(np.arange(len(present)), per_segment)
    within = np.arange(len(segment)) - np.repeat(np.cumsum(per_segment) - per_segment, per_segment)
    start = starts[segment] + within * block
    end = np.minimum(start + block, starts[segment] + counts[segment])
    tiles = np.stack([start, end, present[segment]], axis=1)
    return tokens.astype(np.int32), tiles.astype(np.int32).reshape(-1, 3)


@triton.jit
def _tile(tiles_ptr, tokens_ptr, BLOCK_T: tl.constexpr):
    """This program's tile: ``(slot, rows, row_mask, token)``, its rows into ``tokens`` (and the
    shrunk buffer), which are real, and their token indices into ``x``/``y``."""
    tile = tl.program_id(0)
    start = tl.load(tiles_ptr + tile * 3)
    end = tl.load(tiles_ptr + tile * 3 + 1)
    slot = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_T)
    row_mask = rows < end
    token = tl.load(tokens_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return slot, rows.to(tl.int64), row_mask, token


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    tokens_ptr,
    tiles_ptr,
    stride_xt,
    stride_as,
    stride_ar,
    stride_os,
    stride_ot,
    in_features,
    rank_rows,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program: one tile's tokens against its slot's ``A``, over every ``splits``-th
    ``BLOCK_K`` slice of the input, into partial sum ``split`` (grid: tiles x splits)."""
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    slot, rows, row_mask, token = _tile(tiles_ptr, tokens_ptr, BLOCK_T)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank_rows
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, in_features, splits * BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        x = tl.load(
            x_ptr + token[:, None] * stride_xt + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        a = tl.load(
            a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None],
            mask=k_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A^T
        acc += tile_dot(x, a, UPCAST)
    out = out_ptr + split.to(tl.int64) * stride_os + rows[:, None] * stride_ot + ranks[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    s_ptr,
    b_ptr,
    y_ptr,
    tokens_ptr,
    tiles_ptr,
    columns_ptr,
    stride_ss,
    stride_st,
    stride_bs,
    stride_bo,
    stride_yt,
    rank,
    splits,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program: one tile's tokens, ``BLOCK_N`` output columns of one piece (grid: tiles x
    column tiles x pieces; tiles past a narrower piece's end return at once)."""
    piece = tl.program_id(2)
    first = tl.load(columns_ptr + piece * 2)
    last = tl.load(columns_ptr + piece * 2 + 1)
    n0 = first + tl.program_id(1) * BLOCK_N
    if n0 >= last:
        return
    slot, rows, row_mask, token = _tile(tiles_ptr, tokens_ptr, BLOCK_T)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    partial = s_ptr + rows[:, None] * stride_st + piece * rank + ranks[None, :]
    shrunk = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for split in range(splits):
        shrunk += tl.load(partial + split * stride_ss, mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_mask = cols < last
    b = tl.load(
        b_ptr + slot * stride_bs + cols[None, :].to(tl.int64) * stride_bo + piece * rank + ranks[:, None],
        mask=rank_mask[:, None] & col_mask[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]: B^T
    delta = tile_dot(shrunk.to(b_ptr.dtype.element_ty), b, UPCAST)
    mask = row_mask[:, None] & col_mask[None, :]
    out = y_ptr + token[:, None] * stride_yt + cols[None, :]
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, tiles: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"activations must be [T, features] with a contiguous last dim, got {tuple(x.shape)}")
    if weights.dim() != 3 or weights.stride(-1) != 1:
        raise ValueError(
            f"stacked weights must be [slots, rows, cols] with a contiguous last dim, got {tuple(weights.shape)}"
        )
    if weights.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported LoRA weight dtype {weights.dtype}")
    if tokens.dtype != torch.int32 or tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != 3:
        raise ValueError("tokens must be int32 [n] and tiles int32 [tiles, 3] (segment_tiles)")


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, tiles: torch.Tensor, block: int
) -> torch.Tensor:
    """``[splits, len(tokens), R]`` float32 partial sums: summed over the first dim, row ``i`` is
    ``A_s x[tokens[i]]`` for its tile's slot ``s`` (:func:`lora_expand` sums them).

    ``x`` ``[T, in]`` and ``a`` ``[slots, R, in]`` of one dtype, last dims contiguous;
    ``tokens``/``tiles`` from :func:`segment_tiles` with the same ``block``."""
    _check(x, a, tokens, tiles)
    if x.dtype != a.dtype or x.shape[1] != a.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit A {tuple(a.shape)} {a.dtype}")
    rank_rows, in_features = a.shape[1], a.shape[2]
    n_tiles = tiles.shape[0]
    block_r = max(MIN_DOT, next_pow2(rank_rows))
    block_k = 64 if block_r <= 64 else 32
    # each split at least 4 slices of the input; a power of two, at most MAX_SPLITS
    splits = min(MAX_SPLITS, cdiv(in_features, 4 * block_k), TARGET_PROGRAMS // max(n_tiles, 1))
    splits = 1 << (max(splits, 1).bit_length() - 1)
    out = torch.empty(splits, tokens.shape[0], rank_rows, dtype=torch.float32, device=x.device)
    if n_tiles:
        _lora_shrink_kernel[(n_tiles, splits)](
            x,
            a,
            out,
            tokens,
            tiles,
            x.stride(0),
            a.stride(0),
            a.stride(1),
            out.stride(0),
            out.stride(1),
            in_features,
            rank_rows,
            BLOCK_T=block,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            UPCAST=upcast_dots(x.dtype),
            num_warps=4,
        )
    return out


def lora_expand(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    tokens: torch.Tensor,
    tiles: torch.Tensor,
    columns: torch.Tensor,
    widest: int,
    block: int,
) -> torch.Tensor:
    """Add ``B_s shrunk[:, i].sum(0)`` into ``y[tokens[i]]`` (in place; ``y`` returned), piece by
    piece: ``columns`` int32 ``[pieces, 2]`` (device) the output columns of each piece, ``widest``
    the widest piece's width (host int: it sizes the grid), each piece reading its own
    ``R / pieces`` rank rows. ``b`` ``[slots, out, R]``; ``y`` ``[T, out]``, any float dtype."""
    _check(y, b, tokens, tiles)
    pieces = columns.shape[0]
    rank_rows = b.shape[2]
    if rank_rows % pieces or shrunk.shape[1:] != (tokens.shape[0], rank_rows) or y.shape[1] != b.shape[1]:
        raise ValueError(
            f"shrunk {tuple(shrunk.shape)}, B {tuple(b.shape)}, y {tuple(y.shape)} and {pieces} pieces do not fit"
        )
    rank = rank_rows // pieces
    # 64 x 128 float32 tiles (the delta and y) spill on 4 warps: prefill tiles take 64 columns.
    block_n = min(128 if block == MIN_DOT else 64, max(MIN_DOT, next_pow2(widest)))
    if tiles.shape[0]:
        _lora_expand_kernel[(tiles.shape[0], cdiv(widest, block_n), pieces)](
            shrunk,
            b,
            y,
            tokens,
            tiles,
            columns,
            shrunk.stride(0),
            shrunk.stride(1),
            b.stride(0),
            b.stride(1),
            y.stride(0),
            rank,
            shrunk.shape[0],
            BLOCK_T=block,
            BLOCK_N=block_n,
            BLOCK_R=max(MIN_DOT, next_pow2(rank)),
            UPCAST=upcast_dots(b.dtype),
            num_warps=4,
        )
    return y


def lora_delta_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    columns: list[tuple[int, int]],
) -> torch.Tensor:
    """Reference: float32 ``y`` plus each token's ``B_s (A_s x)``, token by token and piece by
    piece (piece ``p`` of ``columns`` reading rank rows ``p*rank .. (p+1)*rank``)."""
    out = y.float().clone()
    rank = a.shape[1] // len(columns)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        shrunk = a[slot].float() @ x[t].float()
        for p, (first, last) in enumerate(columns):
            ranks = slice(p * rank, (p + 1) * rank)
            out[t, first:last] += b[slot, first:last, ranks].float() @ shrunk[ranks]
    return out
