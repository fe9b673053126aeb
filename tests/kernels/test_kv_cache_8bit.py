"""The Triton kernels over an 8-bit KV cache (``--kv-cache-dtype fp8|int8``), against float32
torch references that quantize and dequantize by definition.

Stores (:mod:`conveyor.kernels.kv_store`, :mod:`conveyor.kernels.rope_kv_store`) must write
the very bytes torch's rule writes (:func:`conveyor.worker.attention.kv_quant.to_cache`:
``x / scale`` clamped and rounded to nearest even by torch's own casts), which is also within
half a step of ``x``; the attention kernels (decode, extend) must match the float32 oracle run
on the dequantized cache (``stored * scale``) to the float32 tolerance; block copies and swaps
move 8-bit blocks bit for bit. Fresh random inputs, random scales, small shapes.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.block_copy import copy_blocks, copy_blocks_ref, swap_blocks, swap_blocks_ref
from conveyor.kernels.extend_attention import extend_attention
from conveyor.kernels.kv_store import kv_store
from conveyor.kernels.paged_decode import paged_decode_attention
from conveyor.kernels.rope_kv_store import norm_rotate_ref, rope_kv_store
from conveyor.worker.attention.kv_quant import FP8, QMAX, KVScales, from_cache, to_cache
from conveyor_tools.kernels.testing import AttentionCase, assert_attention_close, paged_attention_ref

DTYPES = (FP8, torch.int8)


def _scales(gen: torch.Generator, cache_dtype: torch.dtype, spread: float = 3.0) -> KVScales:
    """Random scales under which N(0, spread) values mostly fit and a few clip."""
    k, v = (spread * (0.5 + torch.rand(2, generator=gen)) / QMAX[cache_dtype]).tolist()
    return KVScales(k, v)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.uint8)


def _quantized_cache(gen, case: AttentionCase, seq_lens, num_tokens, cache_dtype, device):
    """``(query, kv, tables, scales)``: a case's random inputs with the cache stored 8-bit."""
    query, kv, tables = case.inputs(seq_lens, num_tokens, device=device, generator=gen)
    scales = _scales(gen, cache_dtype)
    stored = torch.stack(
        [to_cache(kv[0] * 2, scales.inv_k, cache_dtype), to_cache(kv[1] * 2, scales.inv_v, cache_dtype)]
    )
    return query, stored, tables, scales


def _dequantized(kv: torch.Tensor, scales: KVScales) -> torch.Tensor:
    return torch.stack([from_cache(kv[0], scales.k), from_cache(kv[1], scales.v)])


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_quantizes_by_the_rule(device, gen, cache_dtype, dtype) -> None:
    tokens, heads, head_dim, block_size, blocks = 11, 3, 64, 4, 8
    key = (3 * torch.randn(tokens, heads, head_dim, generator=gen)).to(device=device, dtype=dtype)
    value = (3 * torch.randn(tokens, heads, head_dim, generator=gen)).to(device=device, dtype=dtype)
    key[0, 0, :4] = torch.tensor([1e-3, -2e-3, 1e4, -1e4])  # subnormal in fp8, and clipped
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens].to(device)
    slots[3] = -1
    scales = _scales(gen, cache_dtype)
    kv = torch.zeros((2, blocks, block_size, heads, head_dim), dtype=cache_dtype, device=device)
    kv_store(key, value, kv, slots, scales.inv_k, scales.inv_v)

    want = torch.zeros_like(kv)
    keep = slots >= 0
    flat = want.view(2, -1, heads, head_dim)
    flat[0, slots[keep]] = to_cache(key[keep], scales.inv_k, cache_dtype)
    flat[1, slots[keep]] = to_cache(value[keep], scales.inv_v, cache_dtype)
    assert torch.equal(_bits(kv), _bits(want))
    # By definition: within half a step of the input where it fits the range.
    got = from_cache(kv.view(2, -1, heads, head_dim)[0, slots[keep]], scales.k).cpu()
    x = key[keep].float().cpu()
    fits = x.abs() <= QMAX[cache_dtype] * scales.k
    step = scales.k if cache_dtype == torch.int8 else torch.maximum(x.abs() / 8, torch.tensor(scales.k * 2.0**-9))
    assert ((got - x).abs() <= step / 2 * 1.0001 + 1e-7)[fits].all()
    assert torch.equal(got[~fits].abs(), torch.full_like(got[~fits], QMAX[cache_dtype] * scales.k))


@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_rope_kv_store_quantizes_the_rotated_key(device, gen, cache_dtype) -> None:
    tokens, heads, kv_heads, head_dim, block_size = 6, 4, 2, 32, 4
    qkv = 2 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device)
    query, key, value = qkv.view(tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(device)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(64).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    slots = torch.randperm(4 * block_size, generator=gen)[:tokens].to(device)
    scales = _scales(gen, cache_dtype)
    kv = torch.zeros((2, 4, block_size, kv_heads, head_dim), dtype=cache_dtype, device=device)
    rotated_key = norm_rotate_ref(key, positions, cos_sin, None, 0.0)
    rope_kv_store(query, key, value, positions, cos_sin, kv, slots, inv_k_scale=scales.inv_k, inv_v_scale=scales.inv_v)

    flat = kv.view(2, -1, kv_heads, head_dim)
    assert torch.equal(_bits(flat[0, slots]), _bits(to_cache(rotated_key, scales.inv_k, cache_dtype)))
    assert torch.equal(_bits(flat[1, slots]), _bits(to_cache(value, scales.inv_v, cache_dtype)))


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize(
    ("dtype", "window", "partition_size"),
    [(torch.float32, None, None), (torch.float32, 20, 16), (torch.bfloat16, None, 32)],
)
def test_paged_decode_dequantizes(device, gen, cache_dtype, dtype, window, partition_size) -> None:
    case = AttentionCase(64, 4, 8, dtype=dtype, window=window)
    seq_lens = (1, 37, 90)
    query, kv, tables, scales = _quantized_cache(gen, case, seq_lens, len(seq_lens), cache_dtype, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(
        query, kv, tables, lens, case.scale, window, partition_size=partition_size, k_scale=scales.k, v_scale=scales.v
    )
    ref = paged_attention_ref(
        query, _dequantized(kv, scales), tables, [(n - 1, 1) for n in seq_lens], case.scale, window
    )
    assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize(("dtype", "window"), [(torch.float32, None), (torch.float32, 7), (torch.bfloat16, None)])
def test_extend_dequantizes(device, gen, cache_dtype, dtype, window) -> None:
    case = AttentionCase(32, 2, 4, dtype=dtype, window=window)
    spans = [(0, 9), (13, 5), (6, 1)]  # a prefill, a chunk after cached context, a decode
    seq_lens = [c + q for c, q in spans]
    num_tokens = sum(q for _, q in spans)
    query, kv, tables, scales = _quantized_cache(gen, case, seq_lens, num_tokens, cache_dtype, device)
    starts = torch.tensor([0, 9, 14, 15], dtype=torch.int32, device=device)
    context = torch.tensor([c for c, _ in spans], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = extend_attention(
        query, kv, tables, starts, context, lens, case.scale, window, k_scale=scales.k, v_scale=scales.v
    )
    ref = paged_attention_ref(query, _dequantized(kv, scales), tables, spans, case.scale, window)
    assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_block_moves_keep_8bit_blocks(device, gen, cache_dtype) -> None:
    """Copy-on-write and swaps move an 8-bit block's bytes unchanged (the scales are per
    layer, never in a block, so nothing else moves)."""
    scales = _scales(gen, cache_dtype)
    whole = to_cache(3 * torch.randn(3, 2, 10, 4, 2, 16, generator=gen), scales.inv_k, cache_dtype).to(device)
    layers = list(whole.unbind(0))
    pairs = torch.tensor([[1, 7], [4, 2], [9, 0]], dtype=torch.int64)
    want = copy_blocks_ref(layers, pairs)
    copy_blocks(layers, pairs)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, want))

    host = [torch.zeros((2, 6, 4, 2, 16), dtype=cache_dtype) for _ in layers]
    want = swap_blocks_ref(layers, host, [3, 5, 1], [0, 1, 4])
    swap_blocks(layers, host, [3, 5, 1], [0, 1, 4])
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(host, want))
