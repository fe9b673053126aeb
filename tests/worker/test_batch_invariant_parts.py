"""The parts of batch-invariant mode, each on fresh random inputs: the fixed-order attention
(a token's output the same bits alone and in any step, and equal to the reference's up to
rounding), the padded projections, and the mode's refusals."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.worker.attention.backend import AttentionLayer, AttentionMetadata
from conveyor.worker.attention.torch_invariant import KEY_CHUNK, TorchInvariantAttention
from conveyor.worker.attention.torch_ref import TorchReferenceAttention
from conveyor.worker.attention.triton_backend import TritonInvariantAttention
from conveyor.worker.batch_invariant import ROW_TILE, invariant_backend, make_batch_invariant
from conveyor.worker.models.layers import Linear, pack_cpu_weights

BLOCK, KV_HEADS, GROUP, DIM = 16, 3, 3, 64


def _sequences(rng: random.Random, count: int, blocks: int) -> list[tuple[int, list[int]]]:
    free = list(range(blocks))
    rng.shuffle(free)
    out = []
    for _ in range(count):
        length = rng.randint(1, 2 * KEY_CHUNK + 5)
        out.append((length, [free.pop() for _ in range(-(-length // BLOCK))]))
    return out


@pytest.mark.parametrize("window", [None, 40])
def test_attention_of_a_token_is_the_same_bits_in_any_step(window):
    rng, blocks = random.Random(window or 0), 200
    torch.manual_seed(window or 0)
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, DIM)
    layer = AttentionLayer(KV_HEADS * GROUP, KV_HEADS, DIM, DIM**-0.5, window, rotary=None, kv_cache=cache)
    seqs = _sequences(rng, 6, blocks)
    queries = [torch.randn(length, KV_HEADS * GROUP, DIM) for length, _ in seqs]

    def attend(parts, backend=None):
        metadata = AttentionMetadata.build(
            [q for _, _, q in parts], [c for _, c, _ in parts], [seqs[i][1] for i, _, _ in parts], BLOCK, "cpu"
        )
        query = torch.cat([queries[i][c : c + q] for i, c, q in parts])
        return (backend or TorchInvariantAttention()).forward(layer, query, metadata), metadata, query

    alone = [attend([(i, 0, length)])[0] for i, (length, _) in enumerate(seqs)]
    for _ in range(8):  # random steps: any sequences, any cached part, any number of new tokens
        parts = []
        for i in rng.sample(range(len(seqs)), rng.randint(1, len(seqs))):
            cached = rng.randrange(seqs[i][0])
            parts.append((i, cached, rng.randint(1, seqs[i][0] - cached)))
        out, row = attend(parts)[0], 0
        for i, cached, new in parts:
            assert torch.equal(out[row : row + new], alone[i][cached : cached + new]), (i, cached, new)
            row += new
    everything = [(i, 0, length) for i, (length, _) in enumerate(seqs)]
    out, metadata, query = attend(everything)
    reference = TorchReferenceAttention().forward(layer, query, metadata)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_stale_slots_never_reach_a_token():
    """NaN in the unused tail of a sequence's last block (another sequence's old KV) is hidden."""
    cache = torch.randn(2, 4, BLOCK, KV_HEADS, DIM)
    cache[:, 1, 5:] = float("nan")
    layer = AttentionLayer(KV_HEADS * GROUP, KV_HEADS, DIM, 0.125, None, rotary=None, kv_cache=cache)
    metadata = AttentionMetadata.build([3], [BLOCK + 2], [[0, 1]], BLOCK, "cpu")
    out = TorchInvariantAttention().forward(layer, torch.randn(3, KV_HEADS * GROUP, DIM), metadata)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("packed", [False, True])
def test_padded_projection_rows_are_the_same_bits_at_any_row_count(packed):
    torch.manual_seed(1)
    model = torch.nn.Module()
    model.proj = Linear(1536, 576, bias=True, dtype=torch.float32, device="cpu")
    torch.nn.init.normal_(model.proj.weight)
    torch.nn.init.normal_(model.proj.bias)
    if packed:
        pack_cpu_weights(model)
    make_batch_invariant(model)
    assert model.proj.row_tile == ROW_TILE
    x = torch.randn(37, 1536)
    together = model.proj(x)
    for start, count in [(0, 1), (1, 2), (4, 5), (9, 13)]:
        assert torch.equal(model.proj(x[start : start + count]), together[start : start + count])
    expected = torch.nn.functional.linear(x.double(), model.proj.weight.double(), model.proj.bias.double())
    torch.testing.assert_close(together.double(), expected, rtol=1e-4, atol=1e-3)


def test_the_mode_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="tensor parallelism"):
        invariant_backend("cuda", "auto", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="not on mps"):
        invariant_backend("mps", "auto")
    assert isinstance(invariant_backend("cuda", "auto"), TritonInvariantAttention)
    assert isinstance(invariant_backend("cpu", "triton"), TritonInvariantAttention)
    with pytest.raises(ValueError, match="drop --attention torch"):
        invariant_backend("cpu", "torch")
    with pytest.raises(ValueError, match="LoRA"):
        invariant_backend("cpu", "auto", lora=True)
    assert isinstance(invariant_backend("cpu", "auto"), TorchInvariantAttention)
