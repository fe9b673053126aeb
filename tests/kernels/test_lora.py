"""Batched LoRA shrink + expand against the per-token float32 reference, on fresh random inputs:
token counts under, at and over a tile, several slots with base (-1) tokens interleaved (the
plan's order, not grouped), fused projections of 1-3 pieces of unequal widths, ranks that are
not powers of two, every dtype, and shrinks split over the input (partial sums) beside
single-pass ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.kernels.lora import lora_delta_ref, lora_expand, lora_shrink, segment_tiles, tile_tokens
from conveyor_tools.kernels.testing import ROUNDED_TOLERANCES, assert_close

CASES = [
    # (tokens, slots, rank, piece widths, in features, dtype)
    (1, 1, 8, [32], 64, torch.float32),
    (13, 3, 5, [40, 8, 8], 48, torch.float32),  # q/k/v-like, rank 5 (padded to 16 in the tile)
    (37, 4, 16, [24, 24], 96, torch.bfloat16),  # gate/up-like; 37 tokens: partial tiles
    (300, 2, 4, [70], 520, torch.float16),  # over 256 tokens: 64-token tiles; long input: split-K
    (9, 2, 16, [160, 16, 16], 40, torch.bfloat16),  # a piece wider than one column tile
]


def _inputs(gen, tokens, slots, rank, widths, in_features, dtype, device):
    """x ~ N(0, 1); A and B scaled so the shrunk values and the delta are O(1), like y."""
    columns, first = [], 0
    for width in widths:
        columns.append((first, first + width))
        first += width
    out_features = first + 3  # columns no piece owns: the expand must leave them alone
    rank_rows = len(widths) * rank
    x = torch.randn(tokens, in_features, generator=gen)
    a = torch.randn(slots, rank_rows, in_features, generator=gen) / in_features**0.5
    b = torch.zeros(slots, out_features, rank_rows)
    for p, (lo, hi) in enumerate(columns):
        b[:, lo:hi, p * rank : (p + 1) * rank] = torch.randn(slots, hi - lo, rank, generator=gen) / rank**0.5
    y = torch.randn(tokens, out_features, generator=gen)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    token_slots[0] = slots - 1  # at least one adapter token
    return [t.to(device=device, dtype=dtype) for t in (x, a, b, y)], token_slots, columns


def _delta(x, a, b, y, token_slots, columns):
    block = tile_tokens(len(token_slots))
    tokens, tiles = segment_tiles(token_slots.numpy(), block)
    tokens, tiles = torch.from_numpy(tokens).to(x.device), torch.from_numpy(tiles).to(x.device)
    cols = torch.tensor(columns, dtype=torch.int32, device=x.device)
    shrunk = lora_shrink(x, a, tokens, tiles, block)
    widest = max(hi - lo for lo, hi in columns)
    return lora_expand(shrunk, b, y.clone(), tokens, tiles, cols, widest, block)


@pytest.mark.parametrize(("tokens", "slots", "rank", "widths", "in_features", "dtype"), CASES)
def test_lora_delta_matches_reference(device, gen, tokens, slots, rank, widths, in_features, dtype) -> None:
    (x, a, b, y), token_slots, columns = _inputs(gen, tokens, slots, rank, widths, in_features, dtype, device)
    got = _delta(x, a, b, y, token_slots, columns)
    want = lora_delta_ref(x, y, a, b, token_slots, columns)
    assert got.dtype == dtype
    assert_close(got, want, ROUNDED_TOLERANCES[dtype])
    base = token_slots < 0
    assert torch.equal(got[base.to(device)], y[base.to(device)])  # base tokens untouched, bit for bit


def test_segment_tiles_cover_each_adapter_token_once() -> None:
    token_slots = np.array([3, -1, 0, 3, 3, -1, 1, 0, 3, -1, 3, 3])
    tokens, tiles = segment_tiles(token_slots, 2)
    assert sorted(tokens.tolist()) == np.flatnonzero(token_slots >= 0).tolist()
    for start, end, slot in tiles.tolist():
        assert 0 < end - start <= 2 and all(token_slots[tokens[start:end]] == slot)
    assert tiles[:, 1].tolist() == sorted(tiles[:, 1].tolist()) and tiles[-1, 1] == len(tokens)
    tokens, tiles = segment_tiles(np.full(5, -1), 16)
    assert tokens.shape == (0,) and tiles.shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [8, 2048])
def test_lora_delta_on_cuda_in_bf16_at_model_shapes(gen, tokens) -> None:
    """A 1B-class qkv projection (hidden 2048, 32/8 heads of 64), 8 slots of rank 16, compiled."""
    (x, a, b, y), token_slots, columns = _inputs(gen, tokens, 8, 16, [2048, 512, 512], 2048, torch.bfloat16, "cuda")
    got = _delta(x, a, b, y, token_slots, columns)
    assert_close(got, lora_delta_ref(x, y, a, b, token_slots, columns), ROUNDED_TOLERANCES[torch.bfloat16])
