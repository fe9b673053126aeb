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

from conveyor.kernels.paged_decode import paged_decode_attention, plan_decode_partitions
from conveyor_tools.kernels.testing import AttentionCase, assert_attention_close, paged_attention_ref

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
    device: torch.device,
    gen: torch.Generator,
    seq_lens: tuple[int, ...],
    case: AttentionCase,
    *,
    partition_size: int | None = None,
    max_seq_len: int | None = None,
    query_len: int = 1,
    strided_query: bool = False,
) -> None:
    """Decode ``query_len`` tokens per sequence of ``seq_lens`` (the last positions of each) with
    ``case``'s shapes into a NaN-filled ``out``: the rows of real sequences must match the
    reference, those of ``seq_len == 0`` padding rows must be zeros."""
    query, kv, tables = case.inputs(
        seq_lens, len(seq_lens) * query_len, device=device, generator=gen, strided_query=strided_query
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(query, float("nan"), memory_format=torch.contiguous_format)

    result = paged_decode_attention(
        query,
        kv,
        tables,
        lens,
        case.scale,
        case.window,
        max_seq_len=max_seq_len,
        partition_size=partition_size,
        out=out,
        query_len=query_len,
    )
    assert result is out
    real = [b for b, n in enumerate(seq_lens) if n]
    rows = [b * query_len + i for b in real for i in range(query_len)]
    spans = [(seq_lens[b] - query_len, query_len) for b in real]
    ref = paged_attention_ref(query[rows], kv, tables[real], spans, case.scale, case.window)
    assert_attention_close(out[rows], ref, case.dtype)
    padding = [b * query_len + i for b, n in enumerate(seq_lens) if not n for i in range(query_len)]
    assert not out[padding].any()


@pytest.mark.parametrize(("head_dim", "ratio", "block_size", "seq_lens", "partition_size"), _grid())
def test_decode_grid(device, gen, head_dim, ratio, block_size, seq_lens, partition_size) -> None:
    _run(device, gen, seq_lens, AttentionCase(head_dim, ratio, block_size), partition_size=partition_size)


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
    _run(device, gen, seq_lens, AttentionCase(head_dim, 4, 16))


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
    _run(device, gen, seq_lens, AttentionCase(64, 4, block_size, window=window), partition_size=partition_size)


@pytest.mark.parametrize(
    ("seq_lens", "head_dim", "ratio", "block_size", "partition_size"),
    [
        ((1, 23, 70), 128, 4, 16, None),
        ((130, 5), 80, 8, 8, 32),
    ],
)
def test_decode_bf16(device, gen, seq_lens, head_dim, ratio, block_size, partition_size) -> None:
    case = AttentionCase(head_dim, ratio, block_size, dtype=torch.bfloat16)
    _run(device, gen, seq_lens, case, partition_size=partition_size)


def test_decode_float16(device, gen) -> None:
    _run(device, gen, (12, 40), AttentionCase(96, 1, 16, dtype=torch.float16))


@pytest.mark.parametrize("partition_size", [None, 16])
@pytest.mark.parametrize(
    ("seq_lens", "ratio", "block_size", "strided_query", "max_seq_len"),
    [
        # The query a strided slice, and a grid sized for max_seq_len far past the real lengths
        # (as a CUDA graph captured for the model's maximum length would be).
        ((3, 50, 18), 4, 16, True, 200),
        # seq_len == 0 rows (batch padding) must come out as zeros, not NaN or stale data.
        ((0, 37, 0), 1, 8, False, 40),
    ],
)
def test_decode_padded_batch(
    device, gen, seq_lens, ratio, block_size, strided_query, max_seq_len, partition_size
) -> None:
    _run(
        device,
        gen,
        seq_lens,
        AttentionCase(64, ratio, block_size),
        partition_size=partition_size,
        max_seq_len=max_seq_len,
        strided_query=strided_query,
    )


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
def test_decode_of_several_query_tokens_per_sequence(
    device, gen, seq_lens, query_len, ratio, window, partition_size, dtype
) -> None:
    """``query_len`` tokens per sequence (a speculative verify in the static decode step): each
    attends causally to its sequence's positions up to its own, across split-K partitions and
    windows."""
    case = AttentionCase(64, ratio, 16, dtype=dtype, window=window)
    _run(device, gen, seq_lens, case, partition_size=partition_size, max_seq_len=max(seq_lens), query_len=query_len)
