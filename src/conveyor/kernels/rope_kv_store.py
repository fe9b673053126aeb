"""Rotary embedding fused with the KV-cache store (and Qwen3's per-head q/k RMSNorm).

After the fused q/k/v projection each layer, unfused, would: normalize q and k per head (Qwen3),
rotate q and k by their positions (a gather of cos/sin, casts, two halves, four multiplies, a
concatenation, per tensor), cast k and v to the cache dtype and scatter them into their slots.
Here one launch does all of it: programs over (token, head tile) read the q, k and v heads once
(strided views of the projection output), rotate q in place and write the rotated k and v
straight into the paged cache.

Layouts: rotate-half rotary (dims ``i`` and ``i + head_dim/2`` form a pair), ``cos_sin``
float32 ``[max_positions, head_dim]`` holding the cos halves then the sin halves (as
:class:`~conveyor.worker.models.layers.RotaryEmbedding` builds it). Rounding follows the unfused
model: the normed head is rounded to the input dtype before the weight multiply, the weighted
head rounded again, and the rotation runs in float32 and is rounded once. Slot ``-1`` skips the
store (padding tokens) but the query is still rotated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import cdiv, check_kv_cache, next_pow2, quant_mode, quantize_kv

__all__ = ["norm_rotate_ref", "rope_kv_store"]


@triton.jit
def _norm_rotate(x1, x2, w_ptr, half, cos, sin, eps, offs, dmask, QK_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """Rotate a ``[BLOCK_H, BLOCK_HALF]`` pair of head halves (float32), after an RMSNorm per
    head row when QK_NORM; returns the halves rounded to DTYPE."""
    if QK_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)
        w1 = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs, mask=dmask, other=0.0).to(tl.float32)
        x1 = ((x1 * inv_rms[:, None]).to(DTYPE).to(tl.float32) * w1[None, :]).to(DTYPE).to(tl.float32)
        x2 = ((x2 * inv_rms[:, None]).to(DTYPE).to(tl.float32) * w2[None, :]).to(DTYPE).to(tl.float32)
    r1 = x1 * cos[None, :] - x2 * sin[None, :]
    r2 = x2 * cos[None, :] + x1 * sin[None, :]
    return r1.to(DTYPE), r2.to(DTYPE)


@triton.jit
def _rope_kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    slot_ptr,
    kv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_kv_kv,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    num_heads,
    num_kv_heads,
    half,
    block_size,
    eps,
    inv_k_scale,
    inv_v_scale,
    QK_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Grid (tokens, query head tiles + kv head tiles): a program rotates one tile of query
    heads in place, or rotates one tile of key heads and stores it with its value heads."""
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    q_tiles = tl.cdiv(num_heads, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    dmask = offs < half
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=dmask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs, mask=dmask, other=0.0)
    if tile < q_tiles:
        heads = tile * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < num_heads) & dmask[None, :]
        src = q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        r1, r2 = _norm_rotate(x1, x2, q_norm_ptr, half, cos, sin, eps, offs, dmask, QK_NORM, q_ptr.dtype.element_ty)
        tl.store(src, r1, mask=mask)
        tl.store(src + half, r2, mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            heads = (tile - q_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = (heads[:, None] < num_kv_heads) & dmask[None, :]
            src_k = k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs[None, :]
            x1 = tl.load(src_k, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src_k + half, mask=mask, other=0.0).to(tl.float32)
            r1, r2 = _norm_rotate(x1, x2, k_norm_ptr, half, cos, sin, eps, offs, dmask, QK_NORM, k_ptr.dtype.element_ty)
            src_v = v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs[None, :]
            v1 = quantize_kv(tl.load(src_v, mask=mask, other=0.0).to(tl.float32), inv_v_scale, QUANT)
            v2 = quantize_kv(tl.load(src_v + half, mask=mask, other=0.0).to(tl.float32), inv_v_scale, QUANT)
            r1 = quantize_kv(r1.to(tl.float32), inv_k_scale, QUANT)
            r2 = quantize_kv(r2.to(tl.float32), inv_k_scale, QUANT)
            # int64: block * stride_kv_block overflows int32 for pools past 2^31 elements.
            dst = (
                kv_ptr
                + (slot // block_size) * stride_kv_block
                + (slot % block_size) * stride_kv_tok
                + heads[:, None] * stride_kv_head
                + offs[None, :]
            )
            cache_ty = kv_ptr.dtype.element_ty
            tl.store(dst, r1.to(cache_ty), mask=mask)
            tl.store(dst + half, r2.to(cache_ty), mask=mask)
            tl.store(dst + stride_kv_kv, v1.to(cache_ty), mask=mask)
            tl.store(dst + stride_kv_kv + half, v2.to(cache_ty), mask=mask)


def rope_kv_store(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    inv_k_scale: float = 1.0,
    inv_v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate ``query`` in place and store rotated ``key`` and ``value`` into the cache ``kv``.

    Args:
        query: ``[T, heads, head_dim]``, key/value ``[T, kv_heads, head_dim]``: any token and
            head strides (views of one fused projection output), head_dim contiguous; one dtype.
        positions: ``[T]`` integer positions, each below ``cos_sin.shape[0]``.
        cos_sin: float32 ``[max_positions, head_dim]`` (cos halves, then sin halves), rows contiguous.
        kv: one layer's cache ``[2, num_blocks, block_size, kv_heads, head_dim]``, written in place.
        slot_mapping: ``[T]`` flat slots, ``-1`` = do not store.
        q_norm_weight, k_norm_weight: ``[head_dim]`` per-head RMSNorm weights applied before
            the rotation (Qwen3), both or neither; ``eps`` their epsilon.
        inv_k_scale, inv_v_scale: an 8-bit cache stores the rotated key (rounded to the input
            dtype first, as a float cache would hold it) times ``inv_k_scale`` and the value times
            ``inv_v_scale``, rounded by :func:`._common.quantize_kv`.

    Returns ``query`` (rotated in place).
    """
    _, block_size, kv_heads, head_dim = check_kv_cache(kv)
    num_tokens, num_heads = query.shape[0], query.shape[1]
    if query.dim() != 3 or query.shape[2] != head_dim or key.shape != (num_tokens, kv_heads, head_dim):
        raise ValueError(
            f"query [T, H, {head_dim}] and key/value [T, {kv_heads}, {head_dim}]; "
            f"got {tuple(query.shape)}, {tuple(key.shape)}"
        )
    if value.shape != key.shape or query.dtype != key.dtype or value.dtype != key.dtype:
        raise ValueError("key and value must have one shape, and q/k/v one dtype")
    if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1 or head_dim % 2:
        raise ValueError("head_dim must be even and contiguous in query, key and value")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError("positions and slot_mapping must be [T]")
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin must be float32 [max_positions, {head_dim}] with contiguous rows")
    qk_norm = q_norm_weight is not None
    if qk_norm != (k_norm_weight is not None):
        raise ValueError("give both q and k norm weights or neither")
    if num_tokens == 0:
        return query
    half = head_dim // 2
    block_half = next_pow2(half)
    # Tiles of about 1K element pairs: whole GQA groups of heads per program at T=1.
    block_h = min(next_pow2(max(num_heads, kv_heads)), max(1, 1024 // block_half))
    grid = (num_tokens, cdiv(num_heads, block_h) + cdiv(kv_heads, block_h))
    _rope_kv_store_kernel[grid](
        query,
        key,
        value,
        positions,
        cos_sin,
        slot_mapping,
        kv,
        q_norm_weight if qk_norm else cos_sin,
        k_norm_weight if qk_norm else cos_sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_sin.stride(0),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        num_heads,
        kv_heads,
        half,
        block_size,
        eps,
        inv_k_scale,
        inv_v_scale,
        QK_NORM=qk_norm,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        QUANT=quant_mode(kv.dtype),
        num_warps=4,
    )
    return query


def norm_rotate_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, norm_weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Reference of the kernel's ``_norm_rotate`` on the query or the key ``[T, heads, head_dim]``:
    per-head RMSNorm when ``norm_weight`` is given, then the rotation by each token's position,
    in float32, rounded to ``x``'s dtype where the model rounds; returned as float32. (The
    kernel's store of the rotated key and the value is :func:`.kv_store.kv_store_ref`'s rule.)"""
    dtype = x.dtype
    cos, sin = cos_sin[positions.long()].unsqueeze(1).chunk(2, dim=-1)
    x = x.float()
    if norm_weight is not None:
        normed = (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype).float()
        x = (normed * norm_weight.float()).to(dtype).float()
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(dtype).float()
