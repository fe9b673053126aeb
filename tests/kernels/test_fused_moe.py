"""The fused MoE kernels (gate/up GEMM with SiLU-and-multiply, down GEMM with the router
weights, top-k sum) against a float32 torch reference on fresh random inputs, over a sparse
sample of the grid: 4-64 experts, top-k 1-8, 1-512 tokens, hidden and expert widths that are
and are not multiples of the tiles (interpreted on CPU, compiled on a GPU); and the alignment
that sorts (token, expert) pairs into expert groups padded to the row block."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.fused_moe import align_by_expert, fused_moe_ref, fused_moe_triton, moe_tiles
from conveyor_tools.kernels.testing import ROUNDED_TOLERANCES, TOLERANCES, assert_close

#: (tokens, experts, top_k, hidden, width): tile multiples (64, 32, 16) and not (40, 48, 72, 24).
CASES = [
    (1, 4, 1, 64, 32),
    (3, 8, 2, 48, 40),
    (17, 16, 4, 80, 24),
    (64, 64, 8, 32, 16),
    (33, 32, 6, 40, 72),
    (200, 8, 2, 64, 48),
    (512, 4, 1, 32, 16),
]


def draw(gen, device, dtype, tokens, experts, top_k, hidden, width):
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * width, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, width, generator=gen) / width**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    to = dict(device=device)
    return x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to), weights.to(**to), ids.to(**to)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "width"), CASES)
def test_fused_moe_matches_float32_reference(device, gen, tokens, experts, top_k, hidden, width) -> None:
    x, w13, w2, weights, ids = draw(gen, device, torch.float32, tokens, experts, top_k, hidden, width)
    out = fused_moe_triton(x, w13, w2, weights, ids)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), TOLERANCES[torch.float32])


def test_bfloat16_and_experts_held_elsewhere(device, gen) -> None:
    """Half precision within its tolerance; ids outside 0..E-1 (another rank's experts under
    expert parallelism) contribute nothing, and a token with only such experts gets zeros."""
    x, w13, w2, weights, ids = draw(gen, device, torch.bfloat16, 24, 8, 3, 48, 40)
    ids = ids - 2  # experts 0, 1 are another rank's (-2, -1); 6, 7 fall outside too once the shard is 0..5
    w13, w2 = w13[:6], w2[:6]
    ids[0] = torch.tensor([-1, 6, 7])
    out = fused_moe_triton(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16 and out[0].abs().max() == 0
    assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), ROUNDED_TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 1), (9, 8, 3), (100, 64, 8)])
def test_alignment_groups_every_pair_under_its_expert(device, gen, tokens, experts, top_k) -> None:
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
    block_m = moe_tiles(tokens * top_k, experts, 16, 16)[0]
    sorted_pairs, block_experts = align_by_expert(ids, experts, block_m)
    capacity = sorted_pairs.numel()
    assert capacity % block_m == 0 and block_experts.numel() == capacity // block_m
    assert capacity >= tokens * top_k + min(experts, tokens * top_k) * (block_m - 1)
    flat = ids.flatten().cpu()
    rows = sorted_pairs.cpu().view(-1, block_m)
    seen = []
    for block, expert in zip(rows, block_experts.cpu().tolist()):
        real = block[block < tokens * top_k]
        if expert < 0:
            assert real.numel() == 0
            continue
        assert (flat[real.long()] == expert).all()
        seen += real.tolist()
    assert sorted(seen) == list(range(tokens * top_k)), "every pair exactly once"
