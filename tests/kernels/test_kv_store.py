"""KV store: new tokens land in exactly their slots; every other slot keeps its old contents.

The cache starts full of random values and the whole cache is compared bit for bit with the
reference, so a store to a wrong slot, a store for a ``-1`` slot, or a torn head row all fail.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.kv_store import kv_store, kv_store_ref
from conveyor_tools.kernels.testing import random_kv_cache

CASES = [
    # (tokens, kv_heads, head_dim, block_size, dtype)
    (1, 1, 64, 8, torch.float32),
    (13, 2, 80, 16, torch.float32),
    (7, 4, 96, 32, torch.float32),
    (20, 8, 128, 16, torch.float32),
    (5, 2, 256, 8, torch.float32),
    (9, 3, 128, 32, torch.bfloat16),
    (11, 2, 80, 16, torch.float16),
]


def _inputs(gen, device, tokens, kv_heads, head_dim, block_size, dtype, *, strided: bool):
    num_blocks = 2 * (-(-tokens // block_size)) + 6
    kv = random_kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device, generator=gen)
    if strided:
        # K and V as views into one fused [T, q + k + v] projection output.
        fused = torch.randn(tokens, 3 * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        key, value = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
        assert tokens == 1 or not key.is_contiguous()
    else:
        key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        value = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    # Distinct random slots anywhere in the pool; about a third skipped.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    skip = torch.rand(tokens, generator=gen) < 0.3
    slots[skip] = -1
    return kv, key, value, slots.to(device)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(("tokens", "kv_heads", "head_dim", "block_size", "dtype"), CASES)
def test_kv_store_matches_reference(device, gen, tokens, kv_heads, head_dim, block_size, dtype, strided) -> None:
    kv, key, value, slots = _inputs(gen, device, tokens, kv_heads, head_dim, block_size, dtype, strided=strided)
    want = kv_store_ref(key, value, kv, slots).to(dtype)
    kv_store(key, value, kv, slots)
    assert torch.equal(kv.cpu(), want.cpu())


def test_kv_store_skips_negative_slots(device, gen) -> None:
    """Only the non-negative slots change; the rest of the cache is bit-identical to before."""
    kv, key, value, _ = _inputs(gen, device, 6, 2, 64, 16, torch.float32, strided=False)
    before = kv.clone()
    slots = torch.tensor([-1, 3, -1, 40, -1, -1], device=device)
    kv_store(key, value, kv, slots)

    changed = (kv != before).any(dim=(-1, -2))  # [2, blocks, block_size]
    flat = changed.reshape(2, -1)
    assert flat[0].nonzero().flatten().tolist() == [3, 40]
    assert flat[1].nonzero().flatten().tolist() == [3, 40]
    assert torch.equal(kv[0, 0, 3], key[1]) and torch.equal(kv[1, 2, 8], value[3])


def test_kv_store_all_skipped_and_empty(device, gen) -> None:
    kv, key, value, _ = _inputs(gen, device, 4, 2, 64, 8, torch.float32, strided=False)
    before = kv.clone()
    kv_store(key, value, kv, torch.full((4,), -1, dtype=torch.int64, device=device))
    kv_store(key[:0], value[:0], kv, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(kv, before)
