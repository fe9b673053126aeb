"""Paged decode attention: one new query token per sequence (or a few: a speculative verify)
against its paged KV history.

Two kernels, split-K ("flash decoding"):

1. ``_decode_partial_kernel``, grid ``(batch, kv_heads, partitions)``. A program owns one KV
   head of one sequence and one contiguous range ("partition") of its context. It loads the
   queries of every head in that KV head's GQA group, for each of the sequence's
   ``query_len`` query tokens, as one ``[BLOCK_M, head_dim]`` tile (row ``r``: token
   ``r // group``, head ``r % group``), so each K/V tile is read from memory once per group
   and step rather than once per query head and token, and runs an online softmax over its
   range. It writes the normalized partial output and its log-sum-exp. (With ``query_len``
   4 and a group of 4 the tile is the 16 rows ``tl.dot`` needs anyway.)
2. ``_decode_reduce_kernel``, grid ``(batch * query_len, heads)``, merges the partitions of a
   query token with the usual rescaling by ``exp(lse_p - max lse)``.

Splitting the context lets batch 1 with a long context occupy every SM; with a large batch, or a
short context, the wrapper picks one partition and the first kernel writes the final output
itself (the reduce kernel is not launched).

Conventions and invariants:

- ``seq_lens[b]`` counts every position including the query tokens, whose K/V is already in
  the cache; query token ``i`` sits at position ``p = seq_lens[b] - query_len + i`` and attends
  causally, to positions ``<= p``.
- Sliding window ``w``: a query attends to the last ``w`` positions including itself,
  ``[p - w + 1, p]``. Partitions tile the range the sequence's queries attend, so a windowed
  sequence never pays for positions none can see; a query token that sees nothing of a
  partition gives it log-sum-exp -inf (weight 0 in the reduce).
- Query heads ``[g * G, (g + 1) * G)`` share KV head ``g`` where ``G = heads // kv_heads``
  (the Hugging Face ``repeat_kv`` order).
- Partition ``p`` of sequence ``b`` covers ``[start + p * P, min(start + (p + 1) * P, seq_len))``
  and exists only when that range is non-empty; the reduce reads only existing partitions. So
  the grid can be sized for an upper bound of the context (fixed across CUDA-graph replays)
  while shorter sequences' surplus programs write nothing.
- ``seq_len == 0`` (padding rows of a captured batch) yields an all-zero output, never NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import attend_paged_span, cdiv, check_paged_attention, next_pow2, store_rows

__all__ = [
    "DecodePlan",
    "paged_decode_attention",
    "plan_decode_partitions",
]

#: Upper bound on partitions per sequence; bounds the float32 scratch to
#: ``batch * heads * MAX_PARTITIONS * head_dim`` elements.
MAX_PARTITIONS = 128
#: A partition shorter than this many KV tiles does not amortize its share of the reduce.
MIN_TILES_PER_PARTITION = 4
#: Aim for this many waves of programs over the SMs when splitting.
TARGET_WAVES = 2


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    kv_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kv_kv,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_bt,
    qk_scale_log2,
    window,
    v_scale,
    stride_mid_b,
    stride_mid_h,
    stride_mid_p,
    partition_size,
    head_dim,
    group_size,
    query_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    first_pos = seq_len - query_len  # the position of the sequence's first query token
    if USE_WINDOW:
        start = tl.maximum(first_pos - window + 1, 0)
    else:
        start = seq_len * 0
    part_start = start + part * partition_size
    # Partitions past the sequence's end have nothing to do; the reduce never reads them.
    # Partition 0 always runs, so a seq_len == 0 row still gets its (zero) output written.
    if part_start >= tl.maximum(seq_len, 1):
        return
    part_end = tl.minimum(part_start + partition_size, seq_len)

    # Row r of the tile: query token r // group_size of the sequence, head r % group_size of
    # the group.
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < query_len * group_size
    heads = kv_head * group_size + offs_m % group_size
    tokens = (b * query_len + offs_m // group_size).to(tl.int64)

    o, lse = attend_paged_span(
        q_ptr + tokens * stride_qb + heads * stride_qh,
        m_mask,
        first_pos + offs_m // group_size,
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
        part_start,
        part_end,
        qk_scale_log2,
        window,
        v_scale,
        BLOCK_N,
        BLOCK_D,
        PAGE,
        USE_WINDOW,
        UPCAST,
    )
    if DIRECT_OUT:
        store_rows(out_ptr + tokens * stride_ob + heads * stride_oh, m_mask, o, head_dim, BLOCK_D)
    else:
        mid = tokens * stride_mid_b + heads * stride_mid_h + part * stride_mid_p
        store_rows(mid_o_ptr + mid, m_mask, o, head_dim, BLOCK_D)
        tl.store(mid_lse_ptr + mid // BLOCK_D, lse, mask=m_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_mid_b,
    stride_mid_h,
    stride_mid_p,
    window,
    partition_size,
    head_dim,
    query_len,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    t = tl.program_id(0)  # a query token: token t // query_len's sequence
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + t // query_len)
    if USE_WINDOW:
        span = tl.minimum(seq_len, window + query_len - 1)
    else:
        span = seq_len
    num_parts = tl.cdiv(span, partition_size)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    base = t.to(tl.int64) * stride_mid_b + h * stride_mid_h

    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # The first chunk holds partition 0, which every query token sees part of (a partition is
    # longer than the query tokens), so the max is finite from there on; a partition a token
    # sees nothing of has lse -inf and weight 0.
    for p0 in range(0, num_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < num_parts
        idx = base + offs_p * stride_mid_p
        lse = tl.load(mid_lse_ptr + idx // BLOCK_D, mask=p_mask, other=float("-inf"))
        o = tl.load(mid_o_ptr + idx[:, None] + offs_d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    l_safe = tl.where(l > 0.0, l, 1.0)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        (acc / l_safe).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class DecodePlan:
    """Tile sizes and split-K partitioning of one decode launch (host-side, cheap to make)."""

    block_n: int  # KV positions per tile
    block_d: int  # head_dim padded to a power of two
    block_g: int  # query rows per program: query tokens x GQA group, padded (tl.dot needs >= 16)
    partition_size: int  # KV positions per split-K partition
    num_partitions: int  # grid size along the context; 1 = no reduce kernel


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # An H100's count, so CPU/interpreter runs plan the way a GPU would.


@functools.lru_cache(maxsize=4096)
def plan_decode_partitions(
    *,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_context: int,
    num_sms: int = 132,
    partition_size: int | None = None,
    query_len: int = 1,
) -> DecodePlan:
    """Choose tiles and the split-K partitioning for a decode launch.

    ``max_context`` is an upper bound on the attended span of any sequence (``seq_len``, or
    ``min(seq_len, window)``). Without an explicit ``partition_size``, the context is split only
    as far as needed to give about ``TARGET_WAVES`` waves of programs over ``num_sms``, never into
    partitions of fewer than ``MIN_TILES_PER_PARTITION`` KV tiles and never into more than
    ``MAX_PARTITIONS``. The partition size is a multiple of the KV tile so tiles never straddle.
    ``query_len`` query tokens per sequence share a program (one tile of their GQA group's rows).
    Cached: every decode launch asks, mostly with the same few shapes.
    """
    block_d = next_pow2(head_dim)
    elem = dtype.itemsize
    # One K (or V) tile <= 16 KiB: for bf16 head_dim 128 that is 64 positions, which compiles
    # for sm_90 with 4 warps in ~120 registers and ~38 KiB shared memory, no spills.
    block_n = max(16, min(64, (16 * 1024) // (block_d * elem)))
    block_g = max(16, next_pow2(query_len * num_heads // num_kv_heads))  # tl.dot needs M >= 16
    max_context = max(1, max_context)
    if partition_size is None:
        tiles = cdiv(max_context, block_n)
        wanted = cdiv(TARGET_WAVES * num_sms, max(1, batch * num_kv_heads))
        by_length = max(1, tiles // MIN_TILES_PER_PARTITION)
        parts = max(1, min(wanted, by_length, MAX_PARTITIONS))
        partition_size = cdiv(tiles, parts) * block_n
    elif partition_size <= 0:
        raise ValueError("partition_size must be positive")
    num_partitions = cdiv(max_context, partition_size)
    return DecodePlan(block_n, block_d, block_g, partition_size, num_partitions)


def paged_decode_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,
    partition_size: int | None = None,
    out: torch.Tensor | None = None,
    query_len: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``query_len`` query tokens per sequence (usually one) over its paged KV
    cache: the sequence's last ``query_len`` positions, each causally (a speculative verify).

    Args:
        query: ``[B * query_len, num_heads, head_dim]`` (sequence-major); heads and tokens may be
            strided, head_dim contiguous.
        kv: one layer's cache ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        block_tables: ``[B, max_blocks]`` int32 block ids; entries past a sequence's end unused.
        seq_lens: ``[B]`` int32 context lengths including the query tokens (already stored).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: attend only to the last ``sliding_window`` positions (None: all).
        max_seq_len: upper bound on ``seq_lens``; pass it to avoid a device->host sync and to
            keep the grid fixed across CUDA-graph replays. Default: ``seq_lens.max()``.
        partition_size: force the split-K partition length in tokens (tests, tuning).
        out: optional ``[B, num_heads, head_dim]`` output buffer.
        k_scale, v_scale: an 8-bit cache's scales (its keys and values are stored / scale).

    Returns ``out`` (allocated with ``query``'s dtype when not given).
    """
    inputs = check_paged_attention(query, kv, block_tables, sliding_window, out)
    query, out, num_kv_heads = inputs.query, inputs.out, inputs.num_kv_heads
    num_tokens, num_heads, head_dim = query.shape
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if batch * query_len != num_tokens:
        raise ValueError(f"query has {num_tokens} tokens for {batch} sequences of {query_len}")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables must be [B, max_blocks] and seq_lens [B]")
    if batch == 0:
        return out

    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + query_len - 1)
    plan = plan_decode_partitions(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=query.dtype,
        max_context=span,
        num_sms=_num_sms(query.device),
        partition_size=partition_size,
        query_len=query_len,
    )
    group = num_heads // num_kv_heads
    direct = plan.num_partitions == 1
    # Scratch: normalized partial outputs [T, H, P, BLOCK_D] and their log2-sum-exp [T, H, P],
    # float32, both contiguous: the lse of (b, h, p) sits at that partial row's offset divided by
    # BLOCK_D, so the kernels address both with one index.
    parts = plan.num_partitions
    if direct:
        mid_o = mid_lse = out  # unused
        mid_strides = (0, 0, 0)
    else:
        mid_o = torch.empty((num_tokens, num_heads, parts, plan.block_d), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((num_tokens, num_heads, parts), dtype=torch.float32, device=query.device)
        mid_strides = mid_o.stride()[:3]
    _decode_partial_kernel[(batch, num_kv_heads, parts)](
        query,
        kv,
        inputs.block_tables,
        seq_lens,
        out,
        mid_o,
        mid_lse,
        *inputs.strides_scale_window(scale, k_scale, v_scale),
        *mid_strides,
        plan.partition_size,
        head_dim,
        group,
        query_len,
        BLOCK_M=plan.block_g,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        DIRECT_OUT=direct,
        **inputs.constants,
        num_warps=4,
        num_stages=2,
    )
    if not direct:
        _decode_reduce_kernel[(num_tokens, num_heads)](
            mid_o,
            mid_lse,
            seq_lens,
            out,
            out.stride(0),
            out.stride(1),
            *mid_strides,
            sliding_window or 0,
            plan.partition_size,
            head_dim,
            query_len,
            BLOCK_P=min(16, next_pow2(parts)),
            BLOCK_D=plan.block_d,
            USE_WINDOW=sliding_window is not None,
            num_warps=4,
        )
    return out
