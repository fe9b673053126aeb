"""Paged decode attention against the dense float32 reference.

Grid: every head size (64, 80, 96, 128, 256) x query/KV head ratio (1, 4, 8) x context set,
with block sizes 8/16/32 rotating through it. Context sets: single-token contexts, lengths that
are not block multiples (batch 3), and long contexts forced across several split-K partitions
(odd partition sizes included, so partitions end mid-tile and mid-block). Further cases cover
the automatic split choice, sliding windows, bfloat16/float16, strided queries, padding rows
(``seq_len == 0``) and a grid sized for a larger ``max_seq_len``.
Tolerance: see ``conveyor_tools.kernels.testing.TOLERANCES`` (fp32: rtol 1e-3, atol 1e-4).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conveyor.kernels.paged_decode import (
    paged_decode_attention,
    paged_decode_attention_ref,
    plan_decode_partitions,
)
from conveyor_tools.kernels.testing import assert_attention_close, random_paged_kv, random_query

HEAD_DIMS = (64, 80, 96, 128, 256)
RATIOS = (1, 4, 8)
BLOCK_SIZES = (8, 16, 32)
# (seq_lens, forced partition size or None for the automatic plan)
CONTEXTS = (
    ((1,), None),
    ((1, 19, 45), None),
    ((301,), 40),  # 8 partitions of 40: each ends mid-block for block sizes 16 and 32
    ((7, 130, 64), 48),
    ((33, 2, 97), None),
)


def _grid() -> list[tuple[int, int, int, tuple[int, ...], int | None]]:
    """Every head size x ratio x context set; block sizes rotate through the product (5 context
    sets against 3 block sizes, so each head shape meets every block size)."""
    cases = []
    for i, (head_dim, ratio, (seq_lens, part)) in enumerate(itertools.product(HEAD_DIMS, RATIOS, CONTEXTS)):
        cases.append((head_dim, ratio, BLOCK_SIZES[i % len(BLOCK_SIZES)], seq_lens, part))
    return cases


def _run(
    *,
    device: torch.device,
    gen: torch.Generator,
    seq_lens: tuple[int, ...],
    head_dim: int,
    ratio: int,
    block_size: int,
    num_kv_heads: int = 2,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    partition_size: int | None = None,
    max_seq_len: int | None = None,
    strided_query: bool = False,
) -> None:
    num_heads = num_kv_heads * ratio
    kv, tables = random_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query = random_query(len(seq_lens), num_heads, head_dim, dtype=dtype, device=device, generator=gen, strided=strided_query)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"), memory_format=torch.contiguous_format)

    result = paged_decode_attention(
        query,
        kv,
        tables,
        lens,
        scale,
        window,
        max_seq_len=max_seq_len,
        partition_size=partition_size,
        out=out,
    )
    assert result is out
    ref = paged_decode_attention_ref(query, kv, tables, lens, scale, window)
    assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize(("head_dim", "ratio", "block_size", "seq_lens", "partition_size"), _grid())
def test_decode_grid(device, gen, head_dim, ratio, block_size, seq_lens, partition_size) -> None:
    _run(device=device, gen=gen, seq_lens=seq_lens, head_dim=head_dim, ratio=ratio, block_size=block_size, partition_size=partition_size)


def test_grid_covers_every_head_size_ratio_and_block_size() -> None:
    cases = _grid()
    assert {c[:2] for c in cases} == set(itertools.product(HEAD_DIMS, RATIOS))
    assert {c[2] for c in cases} == set(BLOCK_SIZES)
    assert {c[3] for c in cases} == {c[0] for c in CONTEXTS}


def test_automatic_plan_splits_long_context(device, gen) -> None:
    """The planner alone (no forced size) splits a long batch-1 context, and the split is right."""
    seq_lens, head_dim = (700,), 64
    plan = plan_decode_partitions(
        batch=1, num_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32, max_context=seq_lens[0]
    )
    assert plan.num_partitions > 1
    assert plan.partition_size % plan.block_n == 0
    _run(device=device, gen=gen, seq_lens=seq_lens, head_dim=head_dim, ratio=4, block_size=16)


def test_automatic_plan_does_not_split_a_full_batch() -> None:
    plan = plan_decode_partitions(
        batch=256, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, max_context=4096
    )
    assert plan.num_partitions == 1


@pytest.mark.parametrize(
    ("seq_lens", "window", "partition_size", "block_size"),
    [
        ((1, 20, 77), 16, None, 8),  # window larger than, equal-ish to and smaller than contexts
        ((150, 9), 100, 24, 16),  # window spread over several partitions, unaligned start
        ((64,), 64, None, 32),  # window exactly the context
        ((90, 33), 1, None, 16),  # attend to the current token only
    ],
)
def test_decode_sliding_window(device, gen, seq_lens, window, partition_size, block_size) -> None:
    _run(
        device=device,
        gen=gen,
        seq_lens=seq_lens,
        head_dim=64,
        ratio=4,
        block_size=block_size,
        window=window,
        partition_size=partition_size,
    )


@pytest.mark.parametrize(
    ("seq_lens", "head_dim", "ratio", "block_size", "partition_size"),
    [
        ((1, 23, 70), 128, 4, 16, None),
        ((130, 5), 80, 8, 8, 32),
    ],
)
def test_decode_bf16(device, gen, seq_lens, head_dim, ratio, block_size, partition_size) -> None:
    _run(
        device=device, gen=gen, seq_lens=seq_lens, head_dim=head_dim, ratio=ratio, block_size=block_size,
        dtype=torch.bfloat16, partition_size=partition_size,
    )


def test_decode_float16(device, gen) -> None:
    _run(device=device, gen=gen, seq_lens=(12, 40), head_dim=96, ratio=1, block_size=16, dtype=torch.float16)


@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_strided_query_and_padded_grid(device, gen, partition_size) -> None:
    """Query as a strided slice, and a grid sized for max_seq_len far past the real lengths (as
    a CUDA graph captured for the model's maximum length would be)."""
    _run(
        device=device,
        gen=gen,
        seq_lens=(3, 50, 18),
        head_dim=64,
        ratio=4,
        block_size=16,
        strided_query=True,
        max_seq_len=200,
        partition_size=partition_size,
    )


@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_padding_rows_are_zero(device, gen, partition_size) -> None:
    """A ``seq_len == 0`` row (batch padding) must come out as zeros, not NaN or stale data."""
    _run(
        device=device,
        gen=gen,
        seq_lens=(0, 37, 0),
        head_dim=64,
        ratio=1,
        block_size=8,
        max_seq_len=40,
        partition_size=partition_size,
    )


def test_reference_matches_direct_softmax(gen) -> None:
    """The reference agrees with attention written out by hand for one tiny case."""
    kv = torch.randn(2, 3, 2, 1, 4, generator=gen)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    q = torch.randn(1, 2, 4, generator=gen)
    keys = torch.stack([kv[0, 2, 0, 0], kv[0, 2, 1, 0], kv[0, 0, 0, 0]])
    values = torch.stack([kv[1, 2, 0, 0], kv[1, 2, 1, 0], kv[1, 0, 0, 0]])
    want = torch.softmax(q[0] @ keys.T * 0.5, dim=-1) @ values
    got = paged_decode_attention_ref(q, kv, table, torch.tensor([3]), 0.5)
    torch.testing.assert_close(got[0], want)


@pytest.mark.parametrize(
    ("seq_lens", "query_len", "ratio", "window", "partition_size", "dtype"),
    [
        ((9, 40, 4), 4, 4, None, None, torch.float32),  # one tile of 16 rows: 4 tokens x 4 heads
        ((301, 64), 4, 4, None, 40, torch.float32),  # split-K: the last partition starts among the queries
        ((130, 75), 3, 8, 50, 16, torch.float32),  # windows: each query token's starts later
        ((70, 5), 2, 1, None, 32, torch.bfloat16),
        ((0, 33), 4, 2, None, 16, torch.float32),  # a padding row (no context): zeros
    ],
)
def test_decode_of_several_query_tokens_per_sequence(device, gen, seq_lens, query_len, ratio, window, partition_size, dtype) -> None:
    """``query_len`` tokens per sequence (a speculative verify in the static decode step): each
    attends causally to its sequence's positions up to its own, as the extend kernel's
    reference computes, across split-K partitions and windows."""
    from conveyor.kernels.extend_attention import extend_attention_ref

    num_kv_heads, head_dim, block_size = 2, 64, 16
    kv, tables = random_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, generator=gen)
    batch = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query = random_query(batch * query_len, num_kv_heads * ratio, head_dim, dtype=dtype, device=device, generator=gen)
    out = paged_decode_attention(
        query, kv, tables, lens, head_dim**-0.5, window, max_seq_len=max(seq_lens), partition_size=partition_size,
        query_len=query_len,
    )
    real = [b for b, n in enumerate(seq_lens) if n]  # (the reference needs seq_len >= query_len)
    rows = torch.tensor([b * query_len + i for b in real for i in range(query_len)], device=device)
    starts = torch.arange(len(real) + 1, dtype=torch.int32, device=device) * query_len
    real_lens = lens[real]
    ref = extend_attention_ref(
        query[rows], kv, tables[real], starts, real_lens - query_len, real_lens, head_dim**-0.5, window
    )
    assert_attention_close(out[rows], ref, dtype)
    padding = [b * query_len + i for b, n in enumerate(seq_lens) if not n for i in range(query_len)]
    assert not out[padding].any()
