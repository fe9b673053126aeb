"""Rotary embedding fused with the KV store (and Qwen3's q/k norm) against the float32 reference.

q, k and v are views of one fused projection output, as the model passes them; the cache starts
full of random values and is compared whole, so a store to a wrong slot, a store for a ``-1``
slot, an unrotated key or a value written rotated all fail. Positions are scattered over the
cos/sin table so a wrong row of it shows.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.kv_store import kv_store_ref
from conveyor.kernels.rope_kv_store import norm_rotate_ref, rope_kv_store
from conveyor.worker.models.layers import RotaryEmbedding
from conveyor_tools.kernels.testing import ROUNDED_TOLERANCES, assert_close, random_kv_cache

EPS = 1e-6
MAX_POSITIONS = 512
CASES = [
    # (tokens, heads, kv_heads, head_dim, block_size, dtype)
    (1, 4, 1, 64, 16, torch.float32),
    (9, 8, 2, 32, 8, torch.float32),
    (5, 6, 3, 80, 16, torch.float32),
    (4, 32, 8, 128, 16, torch.float32),
    (6, 8, 2, 64, 16, torch.bfloat16),
    (3, 4, 4, 96, 8, torch.float16),
]


def _inputs(gen, device, tokens, heads, kv_heads, head_dim, block_size, dtype, qk_norm):
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim + 8, generator=gen).to(device=device, dtype=dtype)
    q, k, v = fused[:, :-8].split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    num_blocks = 2 * (-(-tokens // block_size)) + 5
    kv = random_kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.3] = -1
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen)
    cos_sin = RotaryEmbedding(head_dim, MAX_POSITIONS, 10000.0, None, device).cos_sin
    norms = {}
    if qk_norm:
        norms = {
            name: (1.0 + 0.2 * torch.randn(head_dim, generator=gen)).to(device=device, dtype=dtype)
            for name in ("q_norm_weight", "k_norm_weight")
        }
    return q, k, v, positions.to(device), cos_sin, kv, slots.to(device), norms


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "block_size", "dtype"), CASES)
def test_rope_kv_store_matches_reference(device, gen, tokens, heads, kv_heads, head_dim, block_size, dtype, qk_norm):
    q, k, v, positions, cos_sin, kv, slots, norms = _inputs(
        gen, device, tokens, heads, kv_heads, head_dim, block_size, dtype, qk_norm
    )
    assert tokens == 1 or not q.is_contiguous()
    want_q = norm_rotate_ref(q, positions, cos_sin, norms.get("q_norm_weight"), EPS)
    want_k = norm_rotate_ref(k, positions, cos_sin, norms.get("k_norm_weight"), EPS)
    want_kv = kv_store_ref(want_k.to(kv.dtype), v.to(kv.dtype), kv, slots)
    k_before, v_before = k.clone(), v.clone()
    out = rope_kv_store(q, k, v, positions, cos_sin, kv, slots, eps=EPS, **norms)
    assert out is q
    tolerance = ROUNDED_TOLERANCES[dtype]
    assert_close(q, want_q, tolerance)
    assert_close(kv, want_kv, tolerance)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    # Values are copied, not rotated: bit-exact in their slots.
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kv[1, slot // block_size, slot % block_size], v[t])


def test_rope_kv_store_matches_the_model_rotary(device, gen) -> None:
    """The kernel rotates exactly as :class:`RotaryEmbedding` does (same cos/sin layout, same pairs)."""
    q, k, v, positions, cos_sin, kv, slots, _ = _inputs(gen, device, 5, 4, 2, 64, 16, torch.float32, False)
    rotary = RotaryEmbedding(64, MAX_POSITIONS, 10000.0, None, device)
    want_q, want_k = rotary(positions, q.clone()), rotary(positions, k.clone())
    rope_kv_store(q, k, v, positions, cos_sin, kv, slots)
    assert_close(q, want_q, ROUNDED_TOLERANCES[torch.float32])
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert_close(kv[0, slot // 16, slot % 16], want_k[t], ROUNDED_TOLERANCES[torch.float32])


def test_rope_kv_store_rejects_bad_inputs(device, gen) -> None:
    q, k, v, positions, cos_sin, kv, slots, norms = _inputs(gen, device, 3, 4, 2, 32, 8, torch.float32, True)
    with pytest.raises(ValueError):
        rope_kv_store(q, k, v, positions, cos_sin, kv, slots, q_norm_weight=norms["q_norm_weight"])
    with pytest.raises(ValueError):
        rope_kv_store(q, k, v, positions, cos_sin.double(), kv, slots)
    with pytest.raises(ValueError):
        rope_kv_store(q, k[:, :1], v[:, :1], positions, cos_sin, kv, slots)
