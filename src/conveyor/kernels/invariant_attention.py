"""Batch-invariant attention over the paged KV cache, for ``--batch-invariant`` on CUDA.

The decode kernel picks its split-K by the batch (to fill the SMs) and the extend kernel
shares a key tile's loop among ``BLOCK_M`` query tokens whose spans differ, so a token's
result moves with its company, its chunk and whether it is prefilled, decoded or verified.
Here a token's arithmetic is fixed by the token alone (its position, window and cached K/V):

1. ``_invariant_split_kernel``, grid ``(tokens, kv_heads, splits)``: a program owns one token, the query
   heads of one KV head's GQA group (the rows of one ``tl.dot`` tile) and one *split* of key
   positions ``[j * S, (j + 1) * S)``, ``S`` = :data:`SPLIT_KEYS` absolute positions. It runs
   the shared online softmax (:func:`~conveyor.kernels._common.attend_paged_span`) over the
   split's keys up to the token's position, in ``BLOCK_N`` tiles from the split's start, and
   writes the normalized partial output and its log-sum-exp.
2. ``_invariant_combine_kernel``, grid ``(tokens, heads)``: merges the token's splits one after
   another, in increasing ``j``, with a running maximum, and writes the output.

Every token takes both steps (one split too), in one order; the number of splits a launch
has only decides how many programs exit at once. The grid is fixed by ``max_seq_len``, so a
captured CUDA graph replays it; a large step runs in slices of tokens to bound the float32
scratch, which leaves each token's arithmetic alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import attend_paged_span, cdiv, check_paged_attention, next_pow2, store_rows

__all__ = ["SPLIT_KEYS", "invariant_attention"]

#: Key positions per split. Part of the mode's numerics: every token of every step splits its
#: keys at these absolute positions.
SPLIT_KEYS = 512
#: Upper bound on the float32 scratch of one launch (partial outputs of a slice of tokens).
SCRATCH_BYTES = 256 << 20


@triton.jit
def _token_position(token_seq_ptr, query_start_loc_ptr, seq_lens_ptr, t):
    """Sequence ``b`` of token ``t`` and its absolute position (-1: a padding row, no context)."""
    b = tl.load(token_seq_ptr + t)
    seq_len = tl.load(seq_lens_ptr + b)
    return b, seq_len - tl.load(query_start_loc_ptr + b + 1) + t


@triton.jit
def _invariant_split_kernel(
    q_ptr, kv_ptr, block_table_ptr, token_seq_ptr, query_start_loc_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv_kv, stride_kv_block, stride_kv_tok, stride_kv_head,
    stride_bt, qk_scale_log2, window, v_scale,
    stride_mid_t, stride_mid_h, stride_mid_s, token_offset, head_dim, group_size, split_keys,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    t_local = tl.program_id(0)
    kv_head = tl.program_id(1)
    s = tl.program_id(2)
    b, pos = _token_position(token_seq_ptr, query_start_loc_ptr, seq_lens_ptr, token_offset + t_local)
    if USE_WINDOW:
        first = tl.maximum(pos - window + 1, 0)
    else:
        first = pos * 0
    j = first // split_keys + s
    start = j * split_keys
    if start > pos:  # past the token (or a padding row, position -1): nothing to do
        return
    end = tl.minimum(start + split_keys, pos + 1)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < group_size
    heads = kv_head * group_size + rows
    q_rows = q_ptr + t_local.to(tl.int64) * stride_qt + heads * stride_qh
    q_pos = tl.full((BLOCK_M,), 0, tl.int32) + pos
    o, lse = attend_paged_span(
        q_rows, row_mask, q_pos, kv_ptr, kv_head, block_table_ptr, b, stride_bt, stride_kv_block, stride_kv_tok,
        stride_kv_head, stride_kv_kv, head_dim, start, end, qk_scale_log2, window, v_scale,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PAGE=PAGE, USE_WINDOW=USE_WINDOW, UPCAST=UPCAST,
    )  # fmt: skip
    mid = t_local.to(tl.int64) * stride_mid_t + heads * stride_mid_h + s * stride_mid_s
    store_rows(mid_o_ptr + mid, row_mask, o, head_dim, BLOCK_D)
    tl.store(mid_lse_ptr + mid // BLOCK_D, lse, mask=row_mask)


@triton.jit
def _invariant_combine_kernel(
    mid_o_ptr, mid_lse_ptr, token_seq_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    stride_ot, stride_oh, stride_mid_t, stride_mid_h, stride_mid_s, token_offset, window, head_dim, split_keys,
    BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr,
):  # fmt: skip
    t_local = tl.program_id(0)
    h = tl.program_id(1)
    _, pos = _token_position(token_seq_ptr, query_start_loc_ptr, seq_lens_ptr, token_offset + t_local)
    if USE_WINDOW:
        first = tl.maximum(pos - window + 1, 0)
    else:
        first = pos * 0
    splits = tl.where(pos >= 0, pos // split_keys - first // split_keys + 1, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    acc = tl.zeros((BLOCK_D,), tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    base = t_local.to(tl.int64) * stride_mid_t + h * stride_mid_h
    for s in range(0, splits):
        lse = tl.load(mid_lse_ptr + (base + s * stride_mid_s) // BLOCK_D)
        o = tl.load(mid_o_ptr + base + s * stride_mid_s + offs_d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + weight * o
        total = total * alpha + weight
        m = m_new
    result = acc / tl.where(total > 0.0, total, 1.0)
    out = out_ptr + t_local.to(tl.int64) * stride_ot + h * stride_oh
    tl.store(out + offs_d, result.to(out_ptr.dtype.element_ty), mask=d_mask)


def invariant_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int,
    split_keys: int = SPLIT_KEYS,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of a ragged batch of new tokens (prefill, chunked prefill, decode, verify
    alike) over its paged KV cache, each token causally to positions ``<= p`` (and ``> p - w``
    with a sliding window ``w``), its bits independent of the rest of the batch.

    ``query`` ``[T, heads, head_dim]``; ``query_start_loc`` int32 ``[B + 1]``: sequence ``b``'s
    tokens are rows ``query_start_loc[b]:query_start_loc[b + 1]``, the last of them at position
    ``seq_lens[b] - 1`` (their K/V already stored); ``max_seq_len`` bounds ``seq_lens`` (it sizes
    the grid: pass a fixed bound under a CUDA graph). ``split_keys``: the split length
    (:data:`SPLIT_KEYS`; tests shorten it). Other arguments as
    :func:`conveyor.kernels.paged_decode.paged_decode_attention`'s. Returns ``[T, heads, head_dim]``.
    """
    inputs = check_paged_attention(query, kv, block_tables, sliding_window, None)
    query, out, num_kv_heads = inputs.query, inputs.out, inputs.num_kv_heads
    num_tokens, num_heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or block_tables.shape[0] != batch:
        raise ValueError("query_start_loc must be [B + 1] and block_tables [B, max_blocks] for seq_lens [B]")
    block_d = next_pow2(head_dim)
    block_n = max(16, min(64, (16 * 1024) // (block_d * query.dtype.itemsize)))
    if split_keys <= 0 or split_keys % block_n:
        raise ValueError(f"split_keys must be a positive multiple of the key tile {block_n}")
    if num_tokens == 0:
        return out
    span = max(1, max_seq_len if sliding_window is None else min(max_seq_len, sliding_window))
    splits = cdiv(span, split_keys) + (sliding_window is not None)  # a window may straddle one more
    group = num_heads // num_kv_heads
    token_seq = (
        torch.searchsorted(
            query_start_loc, torch.arange(num_tokens, dtype=query_start_loc.dtype, device=query.device), right=True
        )
        - 1
    )
    per_token = num_heads * splits * block_d * 4
    step = max(1, min(num_tokens, SCRATCH_BYTES // per_token))
    mid_o = torch.empty((step, num_heads, splits, block_d), dtype=torch.float32, device=query.device)
    mid_lse = torch.empty((step, num_heads, splits), dtype=torch.float32, device=query.device)
    mid_strides = mid_o.stride()[:3]
    args = inputs.strides_scale_window(scale, k_scale, v_scale)
    for t0 in range(0, num_tokens, step):
        count = min(step, num_tokens - t0)
        _invariant_split_kernel[(count, num_kv_heads, splits)](
            query[t0:], kv, inputs.block_tables, token_seq, query_start_loc, seq_lens, mid_o, mid_lse,
            *args, *mid_strides, t0, head_dim, group, split_keys,
            BLOCK_M=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d, **inputs.constants,
            num_warps=4, num_stages=2,
        )  # fmt: skip
        _invariant_combine_kernel[(count, num_heads)](
            mid_o, mid_lse, token_seq, query_start_loc, seq_lens, out[t0:], out.stride(0), out.stride(1),
            *mid_strides, t0, sliding_window or 0, head_dim, split_keys,
            BLOCK_D=block_d, USE_WINDOW=sliding_window is not None, num_warps=1,
        )  # fmt: skip
    return out
