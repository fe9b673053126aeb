"""Prefill/extend attention against the dense float32 reference.

Each case is a ragged batch of ``(context_len, new_tokens)`` sequences: plain prefill
(context 0, including a single token), chunked prefill and prefix reuse (cached contexts that
are and are not block multiples), a decode-like one-token extend after a cached prefix, and long
extends spanning several query tiles. Grid: every head size x query/KV head ratio x short case
set, and every head size with the long sets; block sizes 8/16/32 rotate through it. Further
cases cover sliding windows, bfloat16/float16, strided queries, a sequence with no new tokens
and an over-sized ``max_query_len``.
Tolerance: see ``conveyor_tools.kernels.testing.TOLERANCES`` (fp32: rtol 1e-3, atol 1e-4).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conveyor.kernels.extend_attention import extend_attention
from conveyor_tools.kernels.testing import AttentionCase, assert_attention_close, paged_attention_ref

HEAD_DIMS = (64, 80, 96, 128, 256)
RATIOS = (1, 4, 8)
BLOCK_SIZES = (8, 16, 32)
# Each entry: one batch as (context_len, new_tokens) per sequence.
SHORT_BATCHES = (
    ((0, 1),),
    ((0, 5), (0, 37), (0, 19)),
    ((20, 17), (0, 5), (50, 40)),
    ((32, 9), (64, 1), (7, 3)),
)
# Several query tiles per sequence; costly under the interpreter, so each head size meets them
# with one ratio (rotating) rather than all three.
LONG_BATCHES = (
    ((0, 150),),
    ((100, 70),),
)


def _kv_heads(ratio: int) -> int:
    """Two KV heads (so KV head 1's query heads are exercised), one for the widest groups to keep
    the interpreter's run time down."""
    return 1 if ratio >= 8 else 2


def _grid() -> list[tuple[int, int, int, tuple[tuple[int, int], ...]]]:
    """Every head size x ratio x short batch, plus every head size with both long batches; block
    sizes rotate so every batch meets every block size."""
    cases = []
    for i, (head_dim, ratio) in enumerate(itertools.product(HEAD_DIMS, RATIOS)):
        for j, batch in enumerate(SHORT_BATCHES):
            cases.append((head_dim, ratio, BLOCK_SIZES[(i + j) % len(BLOCK_SIZES)], batch))
    for i, head_dim in enumerate(HEAD_DIMS):
        for j, batch in enumerate(LONG_BATCHES):
            ratio = RATIOS[(i + j) % len(RATIOS)]
            cases.append((head_dim, ratio, BLOCK_SIZES[(i + 2 * j) % len(BLOCK_SIZES)], batch))
    return cases


def _run(
    device: torch.device,
    gen: torch.Generator,
    batch: tuple[tuple[int, int], ...],
    case: AttentionCase,
    *,
    max_query_len: int | None = None,
    strided_query: bool = False,
) -> None:
    """Extend ``batch`` (``(context_len, new_tokens)`` per sequence) with ``case``'s shapes into a
    NaN-filled ``out`` and compare with the reference."""
    seq_lens = [c + n for c, n in batch]
    starts = [0]
    for _, n in batch:
        starts.append(starts[-1] + n)
    query, kv, tables = case.inputs(seq_lens, starts[-1], device=device, generator=gen, strided_query=strided_query)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    context_lens = as_i32([c for c, _ in batch])
    out = torch.full_like(query, float("nan"), memory_format=torch.contiguous_format)

    result = extend_attention(
        query,
        kv,
        tables,
        as_i32(starts),
        context_lens,
        as_i32(seq_lens),
        case.scale,
        case.window,
        max_query_len=max_query_len,
        out=out,
    )
    assert result is out
    assert_attention_close(out, paged_attention_ref(query, kv, tables, batch, case.scale, case.window), case.dtype)


@pytest.mark.parametrize(("head_dim", "ratio", "block_size", "batch"), _grid())
def test_extend_grid(device, gen, head_dim, ratio, block_size, batch) -> None:
    _run(device, gen, batch, AttentionCase(head_dim, ratio, block_size, num_kv_heads=_kv_heads(ratio)))


def test_grid_covers_every_head_size_ratio_and_block_size() -> None:
    cases = _grid()
    assert {c[:2] for c in cases} == set(itertools.product(HEAD_DIMS, RATIOS))
    assert {c[2] for c in cases} == set(BLOCK_SIZES)
    for batch in SHORT_BATCHES + LONG_BATCHES:  # every batch meets every block size somewhere
        assert {c[2] for c in cases if c[3] == batch} == set(BLOCK_SIZES)


@pytest.mark.parametrize(
    ("batch", "window", "block_size"),
    [
        (((0, 40), (30, 25), (5, 1)), 16, 8),  # window inside the new tokens and across the prefix
        (((0, 150),), 33, 16),  # rows whose window starts several K/V tiles after the tile's first
        (((60, 20),), 100, 32),  # window longer than the whole sequence
        (((10, 12),), 1, 16),  # each token sees only itself
    ],
)
def test_extend_sliding_window(device, gen, batch, window, block_size) -> None:
    _run(device, gen, batch, AttentionCase(64, 4, block_size, window=window))


@pytest.mark.parametrize(
    ("batch", "head_dim", "ratio", "block_size"),
    [
        (((0, 33), (40, 20)), 128, 4, 16),
        (((17, 70),), 96, 8, 32),
    ],
)
def test_extend_bf16(device, gen, batch, head_dim, ratio, block_size) -> None:
    _run(device, gen, batch, AttentionCase(head_dim, ratio, block_size, dtype=torch.bfloat16))


def test_extend_float16(device, gen) -> None:
    _run(device, gen, ((8, 24), (0, 9)), AttentionCase(80, 1, 8, dtype=torch.float16))


def test_extend_strided_query_empty_sequence_and_padded_grid(device, gen) -> None:
    """A strided query, a sequence with no new tokens in the middle of the batch, and a grid
    sized for more query tiles than any sequence has."""
    _run(device, gen, ((3, 10), (16, 0), (0, 21)), AttentionCase(64, 4, 16), strided_query=True, max_query_len=200)


def test_reference_matches_direct_softmax(gen) -> None:
    """The reference agrees with a hand-written causal attention for one tiny chunked case
    (its last row is a decode row: the one new token that sees the whole context)."""
    kv = torch.randn(2, 4, 2, 1, 4, generator=gen)
    table = torch.tensor([[3, 1]], dtype=torch.int32)  # positions 0,1 in block 3; 2,3 in block 1
    q = torch.randn(2, 1, 4, generator=gen)  # new tokens at positions 2 and 3
    keys = torch.stack([kv[0, 3, 0, 0], kv[0, 3, 1, 0], kv[0, 1, 0, 0], kv[0, 1, 1, 0]])
    values = torch.stack([kv[1, 3, 0, 0], kv[1, 3, 1, 0], kv[1, 1, 0, 0], kv[1, 1, 1, 0]])
    want = torch.stack(
        [
            torch.softmax(q[0, 0] @ keys[:3].T * 0.5, dim=-1) @ values[:3],
            torch.softmax(q[1, 0] @ keys.T * 0.5, dim=-1) @ values,
        ]
    )
    got = paged_attention_ref(q, kv, table, [(2, 2)], 0.5)
    torch.testing.assert_close(got[:, 0], want)
