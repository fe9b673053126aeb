"""Batch-invariant paged attention against the float32 reference, and a token's bits the same
whatever else the launch holds: one sequence alone or beside others, a prompt in one chunk or
several, its last tokens as a prefill's rows, a decode step or a verify step. Short splits
(``split_keys`` 64) so that the interpreted cases cross several."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.invariant_attention import invariant_attention
from conveyor_tools.kernels.testing import AttentionCase, assert_attention_close, paged_attention_ref

SPLIT = 64
CASES = (
    AttentionCase(head_dim=32, ratio=3, block_size=16, num_kv_heads=1),
    AttentionCase(head_dim=64, ratio=2, block_size=8, num_kv_heads=1, dtype=torch.bfloat16, window=50),
)


def _run(case, query, kv, tables, spans, max_seq_len=None):
    """Attention of the rows ``query`` for sequences ``spans`` (context, new tokens) of ``tables``."""
    device = query.device
    starts = torch.tensor([0] + [n for _, n in spans], device=device).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in spans], dtype=torch.int32, device=device)
    return invariant_attention(
        query, kv, tables, starts, seq_lens, case.scale, case.window,
        max_seq_len=max_seq_len or int(seq_lens.max()), split_keys=SPLIT,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=("f32-gqa3", "bf16-window"))
def test_invariant_attention_matches_reference(device, gen, case) -> None:
    spans = ((0, 5), (150, 1), (70, 3))
    q, kv, tables = case.inputs([c + n for c, n in spans], 9, device=device, generator=gen, strided_query=True)
    out = _run(case, q, kv, tables, spans, max_seq_len=300)  # a grid sized for a larger bound
    assert out.dtype == case.dtype
    ref = paged_attention_ref(q, kv, tables, spans, case.scale, case.window)
    assert_attention_close(out, ref, case.dtype)


@pytest.mark.parametrize("case", CASES, ids=("f32-gqa3", "bf16-window"))
def test_a_token_gets_the_same_bits_in_any_step(device, gen, case) -> None:
    length = 80  # a prompt of two splits, its K/V in the cache
    q, kv, tables = case.inputs([length, 90, 1], length, device=device, generator=gen)
    t = tables[:1]
    whole = _run(case, q, kv, t, ((0, length),))
    # Chunked prefill: the same rows in chunks whose boundaries fall inside and across splits.
    chunks, done = [], 0
    for size in (30, 1, 35, length - 66):
        chunks.append(_run(case, q[done : done + size], kv, t, ((done, size),)))
        done += size
    assert torch.equal(torch.cat(chunks), whole)
    # A decode step (last token alone), a verify step (last three), and both beside other
    # sequences of other lengths, in a padded batch's longer grid.
    assert torch.equal(_run(case, q[-1:], kv, t, ((length - 1, 1),)), whole[-1:])
    assert torch.equal(_run(case, q[-3:], kv, t, ((length - 3, 3),)), whole[-3:])
    others = q[:5]
    beside = _run(
        case, torch.cat([others[:4], q[-3:], others[4:]]), kv, tables[[1, 0, 2]], ((86, 4), (77, 3), (0, 1)), 300
    )
    assert torch.equal(beside[4:7], whole[-3:])
