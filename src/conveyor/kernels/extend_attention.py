"""Prefill / extend attention over the paged KV cache for a ragged batch of new tokens.

One kernel serves plain prefill (``context_lens == 0``), chunked prefill (the earlier chunks are
the cached context) and prefix reuse (the shared prefix's blocks are the cached context): in each
case sequence ``b`` brings ``q_len = query_start_loc[b+1] - query_start_loc[b]`` new tokens whose
K/V are already stored, and new token ``i`` sits at absolute position ``context_lens[b] + i``.
It attends to every cached position and causally to the new tokens up to itself, i.e. to
positions ``[0, context_lens[b] + i]`` (``[pos - window + 1, pos]`` with a sliding window).

Grid ``(query tiles, heads, batch)``: a program owns ``BLOCK_M`` consecutive new tokens of one
sequence for one query head and streams K/V tiles of ``BLOCK_N`` positions, gathered through the
block table, from the first position any of its rows can see to the last (so the causal upper
triangle and positions before the window are never loaded). Online softmax in float32 with
base-2 exponentials. Query heads of a GQA group map to KV head ``h // (heads // kv_heads)`` and
reread the same K/V tiles, which then come from L2.

Invariants: ``seq_lens[b] == context_lens[b] + q_len`` and the block table covers
``seq_lens[b]`` positions. Programs whose tile starts past the sequence's new tokens exit at
once, so the grid may be sized for an upper bound of ``q_len`` (fixed per captured graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import attend_paged_span, cdiv, check_paged_attention, next_pow2, store_rows

__all__ = ["extend_attention"]


@triton.jit
def _extend_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    seq_lens_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv_kv,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_bt,
    qk_scale_log2,
    window,
    v_scale,
    head_dim,
    group_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    first_row = tile * BLOCK_M
    if first_row >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b)
    kv_head = h // group_size

    offs_m = first_row + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)

    # Visible span of the tile: through its last row's position (causal), from its first row's
    # window start.
    kv_end = tl.minimum(seq_len, ctx_len + first_row + BLOCK_M)
    if USE_WINDOW:
        kv_start = tl.maximum(ctx_len + first_row - window + 1, 0)
    else:
        kv_start = ctx_len * 0

    o, _ = attend_paged_span(
        q_ptr + rows * stride_qt + h * stride_qh,
        m_mask,
        ctx_len + offs_m,
        kv_ptr,
        kv_head,
        block_table_ptr,
        b,
        stride_bt,
        stride_kv_block,
        stride_kv_tok,
        stride_kv_head,
        stride_kv_kv,
        head_dim,
        kv_start,
        kv_end,
        qk_scale_log2,
        window,
        v_scale,
        BLOCK_N,
        BLOCK_D,
        PAGE,
        USE_WINDOW,
        UPCAST,
    )
    store_rows(out_ptr + rows * stride_ot + h * stride_oh, m_mask, o, head_dim, BLOCK_D)


def _tiles(head_dim: int, dtype: torch.dtype, max_query_len: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D, num_warps)`` for an H100-class GPU.

    Q tile <= 32 KiB and each K/V tile <= 16 KiB of shared memory, so Q plus two stages of K and
    V stay well under the 228 KiB an SM offers even for head_dim 256 in float32. Short extends
    (speculative tokens, small chunks) get shorter Q tiles instead of mostly-masked 128-row ones;
    there are at most four heights, so at most four compiled variants per head size.
    """
    block_d = next_pow2(head_dim)
    elem = dtype.itemsize
    block_m = max(16, min(128, (32 * 1024) // (block_d * elem), next_pow2(max_query_len)))
    if dtype == torch.float32:
        # IEEE float32 dots run on FMA units with operands in registers: taller tiles spill
        # heavily (64x128 needs an 8 KiB stack frame per thread; 32 rows need none).
        block_m = min(block_m, 32)
    block_n = max(16, min(64, (16 * 1024) // (block_d * elem)))
    # 8 warps once the tile is large: checked offline (ptxas for sm_90, bf16) that these tiles
    # compile without register spills, e.g. 128x128 with 8 warps uses ~210 registers per thread
    # while 4 warps spill.
    num_warps = 8 if block_m >= 128 or block_d >= 256 else 4
    return block_m, block_n, block_d, num_warps


def extend_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a ragged batch of new tokens over their sequences' paged KV.

    Args:
        query: ``[T, num_heads, head_dim]`` new tokens of all sequences, concatenated; token and
            head strides free, head_dim contiguous.
        kv: one layer's cache ``[2, num_blocks, block_size, kv_heads, head_dim]`` already holding
            the new tokens' K/V.
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``[B + 1]`` int32 offsets of each sequence's new tokens in ``query``.
        context_lens: ``[B]`` int32 positions cached before this step.
        seq_lens: ``[B]`` int32, ``context_lens + new tokens``.
        scale: softmax scale.
        sliding_window: each token sees only the last ``sliding_window`` positions up to and
            including itself (None: all).
        max_query_len: upper bound on new tokens per sequence; pass it to avoid a device->host
            sync and to fix the grid. Default: computed from ``query_start_loc``.
        out: optional ``[T, num_heads, head_dim]`` output buffer.
        k_scale, v_scale: an 8-bit cache's scales (its keys and values are stored / scale).
    """
    inputs = check_paged_attention(query, kv, block_tables, sliding_window, out)
    query, out = inputs.query, inputs.out
    num_tokens, num_heads, head_dim = query.shape
    batch = context_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or seq_lens.shape != (batch,) or block_tables.shape[0] != batch:
        raise ValueError("query_start_loc must be [B+1]; context_lens, seq_lens, block_tables [B, ...]")
    if num_tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out

    block_m, block_n, block_d, num_warps = _tiles(head_dim, query.dtype, max_query_len)
    grid = (cdiv(max_query_len, block_m), num_heads, batch)
    _extend_kernel[grid](
        query,
        kv,
        out,
        inputs.block_tables,
        query_start_loc,
        context_lens,
        seq_lens,
        *inputs.strides_scale_window(scale, k_scale, v_scale),
        head_dim,
        num_heads // inputs.num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **inputs.constants,
        num_warps=num_warps,
        num_stages=2,
    )
    return out
