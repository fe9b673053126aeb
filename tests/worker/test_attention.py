"""The torch attention backends over the paged KV cache.

* Both backends against dense float64 attention computed directly from the same random keys,
  values and queries (stored through ``store_kv``): random block tables, contexts of 0, 1 and
  non-multiples of the block size, GQA ratios 1/2/4, with and without a sliding window.
* The batched CPU backend (:class:`TorchBatchedAttention`) against the per-sequence reference
  (:class:`TorchReferenceAttention`) on fresh random caches: decode-only, prefill-only and
  mixed steps, GQA and MQA, sliding windows, blocks shared between sequences, block tables
  wider than needed, bf16/fp16 caches, prefills cut into tiles and groups by a small scratch
  budget, NaN in every slot no sequence owns, and random steps from a range of seeds.
* Mutation checks: a batched backend with a wrong mask (off by one at the diagonal or at the
  window's edge) must fail the same comparisons, so they can fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.attention import torch_batched
from conveyor.worker.attention.backend import AttentionLayer, AttentionMetadata, token_positions
from conveyor.worker.attention.torch_batched import TorchBatchedAttention
from conveyor.worker.attention.torch_ref import TorchReferenceAttention
from conveyor.worker.attention.triton_backend import backend_for
from conveyor.worker.models.layers import RotaryEmbedding
from conveyor_tools.kernels.testing import assert_attention_close

HEAD_DIM = 8
# (context_len, query_len): decode after 1 token, pure prefill, non-multiples, long chunk.
SEQUENCES = [(1, 1), (0, 5), (7, 1), (16, 3), (33, 9), (5, 12)]
BACKENDS = {"reference": TorchReferenceAttention, "batched": TorchBatchedAttention}


def attention_layer(query: torch.Tensor, cache: torch.Tensor, window: int | None) -> AttentionLayer:
    """The layer a model with ``query``'s heads over ``cache`` passes (scale 1/sqrt(head_dim));
    ``forward`` reads no rotary table, but a layer always has one."""
    num_heads, head_dim = query.shape[1:]
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, "cpu")
    return AttentionLayer(num_heads, cache.shape[3], head_dim, head_dim**-0.5, window, rotary, kv_cache=cache)


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


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense(backend_name, num_heads, num_kv_heads, block_size, window):
    generator = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads * 10 + block_size)
    backend = BACKENDS[backend_name]()
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

    out = backend.forward(attention_layer(query, cache, window), query, metadata)

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


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_store_kv_skips_negative_slots(backend_name):
    cache = torch.zeros(2, 2, 2, 1, 1)
    metadata = AttentionMetadata.build([2], [0], [[1]], 2, "cpu")
    metadata.slot_mapping = torch.tensor([3, -1])
    BACKENDS[backend_name]().store_kv(
        torch.tensor([[[1.0]], [[2.0]]]), torch.tensor([[[3.0]], [[4.0]]]), cache, metadata
    )
    assert cache[0].flatten().tolist() == [0.0, 0.0, 0.0, 1.0]
    assert cache[1].flatten().tolist() == [0.0, 0.0, 0.0, 3.0]


def test_backend_for_picks_batched_torch_on_cpu():
    assert type(backend_for("cpu")) is TorchBatchedAttention
    assert type(backend_for("cpu", "torch")) is TorchBatchedAttention
    assert type(backend_for("cpu", "torch-ref")) is TorchReferenceAttention
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend_for("cpu", "flash")


# ------------------------------------------------------------ batched against the reference


@dataclass
class Step:
    """One step's inputs over a random cache: the same for both backends."""

    query: torch.Tensor
    cache: torch.Tensor
    metadata: AttentionMetadata

    def layer(self, window: int | None) -> AttentionLayer:
        return attention_layer(self.query, self.cache, window)


def make_step(
    sequences: list[tuple[int, int]],
    *,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 16,
    block_size: int = 4,
    cache_dtype: torch.dtype = torch.float32,
    query_dtype: torch.dtype = torch.float32,
    shared_blocks: int = 0,
    extra_columns: int = 0,
    poison_unowned: bool = False,
    seed: int = 0,
) -> Step:
    """A step over ``sequences`` ``(context_len, query_len)`` with every cache slot random.

    Blocks come shuffled from a pool with spares. ``shared_blocks``: every sequence whose
    context holds that many full blocks starts with the first such sequence's blocks (a shared
    prefix). ``extra_columns``: the block table gets that many more columns of random valid
    blocks after each row's last needed block. ``poison_unowned``: every slot at or past a
    sequence's length in its own blocks, and every block no sequence uses, holds NaN.
    """
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in sequences]
    num_blocks = sum(needed) + 8
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables: list[list[int]] = []
    prefix: list[int] | None = None
    for (context_len, _), n in zip(sequences, needed):
        if shared_blocks and context_len >= shared_blocks * block_size:
            if prefix is None:
                prefix = [free.pop() for _ in range(shared_blocks)]
            tables.append(prefix + [free.pop() for _ in range(n - shared_blocks)])
        else:
            tables.append([free.pop() for _ in range(n)])
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    if poison_unowned:
        owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for (context_len, query_len), table in zip(sequences, tables):
            flat = torch.arange(context_len + query_len)
            owned[torch.tensor(table)[flat // block_size], flat % block_size] = True
        cache[:, ~owned] = float("nan")
    query_lens = [q for _, q in sequences]
    metadata = AttentionMetadata.build(query_lens, [c for c, _ in sequences], tables, block_size, "cpu")
    if extra_columns:
        width = metadata.block_tables.shape[1] + extra_columns
        wide = torch.randint(0, num_blocks, (len(sequences), width), generator=generator, dtype=torch.int32)
        for row, (table, n) in enumerate(zip(tables, needed)):
            wide[row, :n] = torch.tensor(table, dtype=torch.int32)
        metadata.block_tables = wide
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(query_dtype)
    return Step(query, cache, metadata)


def assert_batched_matches_reference(
    step: Step, window: int | None, scratch_bytes: int | None = None, rtol: float = 1e-5, atol: float = 1e-5
) -> None:
    batched = TorchBatchedAttention() if scratch_bytes is None else TorchBatchedAttention(scratch_bytes)
    out = batched.forward(step.layer(window), step.query, step.metadata)
    ref = TorchReferenceAttention().forward(step.layer(window), step.query, step.metadata)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite outputs"
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


DECODES = [(c, 1) for c in (0, 1, 3, 4, 5, 17, 31, 32, 40, 63, 9, 2)]
PREFILLS = [(0, 1), (0, 4), (0, 7), (0, 33), (0, 64), (0, 13)]
CHUNKS = [(8, 5), (3, 9), (20, 16), (1, 2)]
KINDS = {"decode": DECODES, "prefill": PREFILLS, "mixed": DECODES[::2] + PREFILLS[::2] + CHUNKS}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 1, 6, 20, 1000])
def test_batched_matches_reference(kind, num_heads, num_kv_heads, window):
    step = make_step(KINDS[kind], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_kv_heads)
    assert_batched_matches_reference(step, window)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 6])
def test_batched_block_sizes(block_size, window):
    step = make_step(KINDS["mixed"], block_size=block_size, seed=block_size)
    assert_batched_matches_reference(step, window)


@pytest.mark.parametrize("window", [None, 6])
def test_batched_shared_prefix_blocks(window):
    """Sequences that share their first blocks (a cached prefix) read them independently."""
    sequences = [(12, 1), (12, 3), (17, 1), (30, 5), (3, 2), (12, 1)]
    step = make_step(sequences, block_size=4, shared_blocks=3, seed=7)
    tables = step.metadata.block_tables
    assert (tables[[0, 1, 2, 3, 5], :3] == tables[0, :3]).all()
    assert_batched_matches_reference(step, window)


@pytest.mark.parametrize("window", [None, 6])
def test_batched_block_tables_wider_than_needed(window):
    step = make_step(KINDS["mixed"], extra_columns=3, seed=11)
    assert_batched_matches_reference(step, window)


@pytest.mark.parametrize("window", [None, 6])
def test_batched_ignores_nan_in_slots_no_sequence_owns(window):
    """Slots past a sequence's end (its last block's tail, table padding, blocks of nobody)
    hold NaN: the reference never reads them and the batched backend must not let them through."""
    step = make_step(KINDS["mixed"], extra_columns=2, poison_unowned=True, seed=13)
    assert_batched_matches_reference(step, window)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 6])
def test_batched_low_precision_cache(cache_dtype, window):
    """Both compute in float32 from the same rounded keys and values: float32 queries must agree
    to float32 rounding; queries in the cache dtype to that dtype's rounding of the output."""
    step = make_step(KINDS["mixed"], cache_dtype=cache_dtype, seed=17)
    assert_batched_matches_reference(step, window)
    step = make_step(KINDS["mixed"], cache_dtype=cache_dtype, query_dtype=cache_dtype, seed=19)
    batched = TorchBatchedAttention().forward(step.layer(window), step.query, step.metadata)
    ref = TorchReferenceAttention().forward(step.layer(window), step.query, step.metadata)
    assert batched.dtype == cache_dtype
    assert_attention_close(batched, ref, cache_dtype)


@pytest.mark.parametrize("scratch_bytes", [1, 4096, 64 << 10])
@pytest.mark.parametrize("window", [None, 6])
def test_batched_small_scratch_budget_splits_prefills(scratch_bytes, window):
    """A budget too small for a whole prefill cuts it into tiles of a few rows (down to the
    floor where scores match keys and values in size) and the step into many groups; the
    answer must not change."""
    sequences = [(0, 70), (5, 1), (40, 33), (9, 1), (0, 3)]
    step = make_step(sequences, block_size=4, seed=23)
    backend = TorchBatchedAttention(scratch_bytes)
    groups = backend._groups(step.metadata, step.layer(window))
    assert len(groups) > 2 and sum(int(g.out_rows.numel()) for g in groups) == step.query.shape[0]
    if scratch_bytes == 1:  # 8 heads, 4 kv heads, head_dim 16: rows floor (2*4*16*4) // (2*4*8) = 8
        assert all(g.n == 1 and g.rows <= 8 for g in groups)
        assert max(g.rows for g in groups) == 8
    assert_batched_matches_reference(step, window, scratch_bytes)


def test_batched_long_prefill_beside_decodes_stays_within_budget():
    """A 600-token prefill beside 40 decodes: no group's float32 scratch exceeds the budget
    (bar a lone tile at the rows floor), decodes are not padded to the prefill's rows."""
    sequences = [(0, 600)] + [(c, 1) for c in range(20, 60)]
    step = make_step(sequences, num_heads=8, num_kv_heads=2, head_dim=16, block_size=16, seed=29)
    budget = 256 << 10
    backend = TorchBatchedAttention(budget)
    per_key, per_score = 2 * 2 * 16 * 4, 2 * 4 * 8
    groups = backend._groups(step.metadata, step.layer(None))
    for g in groups:
        assert g.n * g.keys * (per_key + g.rows * per_score) <= budget or (g.n == 1 and g.rows <= 4)
        if g.rows > 1:  # prefill tiles (rows 0..599) never share a group with the decodes
            assert (g.out_rows < 600).all()
    assert len([g for g in groups if g.rows > 1]) > 1, "the prefill must be cut into tiles"
    assert sum(g.n for g in groups if g.rows == 1) >= 40
    assert_batched_matches_reference(step, None, budget)


def test_batched_plan_follows_metadata_and_window():
    """Plans are kept per step (metadata object) and window: a layer with another window, or
    the next step, gets its own."""
    backend = TorchBatchedAttention()
    first = make_step(KINDS["mixed"], seed=31)
    second = make_step(KINDS["decode"], seed=37)
    for step, window in [(first, None), (first, 4), (first, None), (second, None), (second, 4), (first, 4)]:
        out = backend.forward(step.layer(window), step.query, step.metadata)
        ref = TorchReferenceAttention().forward(step.layer(window), step.query, step.metadata)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_batched_plan_follows_metadata_changed_in_place():
    """Metadata reused as an object for another step (lengths and table replaced) gets a new plan."""
    first = make_step(KINDS["decode"], seed=47)
    second = make_step(KINDS["mixed"], seed=53)
    backend = TorchBatchedAttention()
    backend.forward(first.layer(None), first.query, first.metadata)
    reused = first.metadata
    for name in vars(second.metadata):
        setattr(reused, name, getattr(second.metadata, name))
    out = backend.forward(second.layer(None), second.query, reused)
    ref = TorchReferenceAttention().forward(second.layer(None), second.query, second.metadata)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_batched_empty_step():
    metadata = AttentionMetadata.build([], [], [], 4, "cpu")
    query = torch.empty(0, 8, 16)
    out = TorchBatchedAttention().forward(attention_layer(query, torch.zeros(2, 4, 4, 4, 16), None), query, metadata)
    assert out.shape == (0, 8, 16)


@pytest.mark.parametrize("seed", range(20))
def test_batched_random_steps(seed):
    """Random shapes, GQA ratios, windows, block sizes and mixes of decodes and chunks."""
    rng = np.random.default_rng(seed)
    num_kv_heads = int(rng.choice([1, 2, 4]))
    num_heads = num_kv_heads * int(rng.choice([1, 2, 3, 4]))
    block_size = int(rng.choice([1, 2, 4, 8, 16]))
    sequences = []
    for _ in range(int(rng.integers(1, 24))):
        context_len = int(rng.integers(0, 80))
        query_len = 1 if rng.random() < 0.6 else int(rng.integers(1, 50))
        sequences.append((context_len, query_len))
    window = None if rng.random() < 0.4 else int(rng.integers(1, 60))
    step = make_step(
        sequences,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(rng.choice([4, 8, 32])),
        block_size=block_size,
        extra_columns=int(rng.integers(0, 3)),
        seed=seed,
    )
    scratch = None if rng.random() < 0.5 else int(rng.integers(1, 1 << 18))
    assert_batched_matches_reference(step, window, scratch)


# ------------------------------------------------------------ the comparisons can fail


def _off_by_one_diagonal(query_pos, key_pos, sliding_window):
    hidden = key_pos >= query_pos  # hides the token from itself
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    return hidden


def _window_one_too_wide(query_pos, key_pos, sliding_window):
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos < query_pos - sliding_window
    return hidden


def _causal_ignored_for_prefill_rows(query_pos, key_pos, sliding_window):
    # Every row sees up to the row's tile end: right for decodes, wrong inside a prefill.
    hidden = key_pos > query_pos.amax(dim=1, keepdim=True).expand_as(query_pos)
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    return hidden


@pytest.mark.parametrize(
    "mutant,kind,window",
    [
        (_off_by_one_diagonal, "decode", None),
        (_off_by_one_diagonal, "prefill", 6),
        (_window_one_too_wide, "decode", 6),
        (_window_one_too_wide, "mixed", 20),
        (_causal_ignored_for_prefill_rows, "prefill", None),
        (_causal_ignored_for_prefill_rows, "mixed", None),
    ],
)
def test_a_wrong_mask_is_caught(monkeypatch, mutant, kind, window):
    step = make_step(KINDS[kind], seed=41)
    assert_batched_matches_reference(step, window)  # the real mask passes...
    monkeypatch.setattr(torch_batched, "hidden_keys", mutant)
    with pytest.raises(AssertionError):  # ...and the mutant fails
        assert_batched_matches_reference(step, window)


def test_a_wrong_kv_head_mapping_is_caught(monkeypatch):
    """Query head h reads kv head h // group: interleaving instead would be caught."""
    step = make_step(KINDS["mixed"], num_heads=8, num_kv_heads=2, seed=43)
    assert_batched_matches_reference(step, None)
    # Reorder the query heads so that contiguous groups become interleaved ones.
    interleave = torch.arange(8).view(4, 2).t().reshape(-1)
    real_forward = TorchBatchedAttention.forward

    def interleaved(self, layer, query, metadata):
        out = real_forward(self, layer, query[:, interleave], metadata)
        return out[:, torch.argsort(interleave)]

    monkeypatch.setattr(TorchBatchedAttention, "forward", interleaved)
    with pytest.raises(AssertionError):
        assert_batched_matches_reference(step, None)


# ------------------------------------------------------------ through the model


def test_reference_and_batched_backends_generate_the_same(checkpoint_factory, scripted, script):
    """Greedy tokens through a ModelRunner on each torch backend (Mistral: sliding window)."""
    from conveyor.worker.model_runner import ModelRunner

    for name in ("llama", "mistral_window"):
        directory, _ = checkpoint_factory(name)
        outputs = {}
        for attention in ("torch", "torch-ref"):
            runner = ModelRunner(RunnerConfig(directory, block_size=4, num_blocks=64, attention=attention))
            generator = torch.Generator().manual_seed(5)
            vocab = runner.model_config.vocab_size
            p = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (1, 11, 19, 6)]
            scripts = [
                script("one-token", p[0], max_new=5),
                script("chunked", p[1], max_new=5, chunk=4),
                script("long", p[2], max_new=4, join=1),
                script("late", p[3], max_new=4, join=2),
            ]
            outputs[attention] = scripted(runner, scripts).run()
        assert outputs["torch"] == outputs["torch-ref"], name
