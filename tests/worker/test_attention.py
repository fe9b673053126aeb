"""TorchPagedAttention against dense float64 attention computed directly from the same
random keys, values and queries: random block tables, contexts of 0, 1 and non-multiples
of the block size, GQA ratios 1/2/4, with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from conveyor.worker.attention.backend import AttentionMetadata, token_positions
from conveyor.worker.attention.torch_ref import TorchPagedAttention

HEAD_DIM = 8
# (context_len, query_len): decode after 1 token, pure prefill, non-multiples, long chunk.
SEQUENCES = [(1, 1), (0, 5), (7, 1), (16, 3), (33, 9), (5, 12)]


def dense_attention(q, k, v, context_len, scale, window):
    """q [Lq, H, D], k/v [S, Hkv, D] for one sequence; float64, each query at position context_len + i."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense(num_heads, num_kv_heads, block_size, window):
    generator = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + block_size)
    backend = TorchPagedAttention()
    num_blocks = 64
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=generator)  # stale garbage
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables, keys, values = [], [], []
    for context_len, query_len in SEQUENCES:
        seq_len = context_len + query_len
        tables.append([free.pop() for _ in range(-(-seq_len // block_size))])
        keys.append(torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=generator))
        values.append(torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=generator))

    # Earlier steps cached the contexts; then this step stores the new tokens and attends.
    cached = [i for i, (context_len, _) in enumerate(SEQUENCES) if context_len]
    prefix = AttentionMetadata.build(
        [SEQUENCES[i][0] for i in cached], [0] * len(cached), [tables[i] for i in cached], block_size, "cpu"
    )
    backend.store_kv(
        torch.cat([keys[i][: SEQUENCES[i][0]] for i in cached]),
        torch.cat([values[i][: SEQUENCES[i][0]] for i in cached]),
        cache,
        prefix,
    )
    context_lens = [c for c, _ in SEQUENCES]
    query_lens = [q for _, q in SEQUENCES]
    metadata = AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cpu")
    new_keys = torch.cat([k[c:] for k, (c, _) in zip(keys, SEQUENCES)])
    new_values = torch.cat([v[c:] for v, (c, _) in zip(values, SEQUENCES)])
    backend.store_kv(new_keys, new_values, cache, metadata)
    query = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5

    out = backend.forward(query, cache, metadata, scale, window)

    assert out.shape == query.shape
    starts = metadata.query_start_loc_host
    for i, (context_len, _) in enumerate(SEQUENCES):
        expected = dense_attention(query[starts[i] : starts[i + 1]], keys[i], values[i], context_len, scale, window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_metadata_layout():
    metadata = AttentionMetadata.build([3, 1], [2, 4], [[9, 4, 7], [1, 6]], 4, "cpu")
    assert metadata.query_start_loc.tolist() == [0, 3, 4]
    assert metadata.seq_lens.tolist() == [5, 5]
    assert metadata.context_lens.tolist() == [2, 4]
    assert metadata.block_tables.tolist() == [[9, 4], [1, 6]]
    # positions 2,3 -> block 9; 4 -> block 4 offset 0; second sequence position 4 -> block 6 offset 0
    assert metadata.slot_mapping.tolist() == [38, 39, 16, 24]
    assert (metadata.max_seq_len, metadata.max_query_len) == (5, 3)
    assert token_positions([3, 1], [2, 4]).tolist() == [2, 3, 4, 4]
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([3], [2], [[1]], 4, "cpu")


def test_store_kv_skips_negative_slots():
    cache = torch.zeros(2, 2, 2, 1, 1)
    metadata = AttentionMetadata.build([2], [0], [[1]], 2, "cpu")
    metadata.slot_mapping = torch.tensor([3, -1])
    TorchPagedAttention().store_kv(torch.tensor([[[1.0]], [[2.0]]]), torch.tensor([[[3.0]], [[4.0]]]), cache, metadata)
    assert cache[0].flatten().tolist() == [0.0, 0.0, 0.0, 1.0]
    assert cache[1].flatten().tolist() == [0.0, 0.0, 0.0, 3.0]
