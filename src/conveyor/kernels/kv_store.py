"""Write the new tokens' K and V into their paged-cache slots.

Every forward step produces K and V for the batch's new tokens as ``[T, kv_heads, head_dim]``
(often strided slices of one fused QKV projection). The scheduler has already chosen a slot for
each token: ``slot_mapping[t] = block_id * block_size + offset``. Slot ``-1`` means "do not
store" (padding tokens of a CUDA-graph batch, or tokens whose KV is not kept); those tokens leave
the cache untouched.

Invariants: a slot appears at most once among the non-negative entries of ``slot_mapping`` (the
block pool never hands one slot to two tokens of a step), so stores never race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import cdiv, check_kv_cache, last_dim_contiguous, next_pow2, quant_mode, quantize_kv

__all__ = ["kv_store", "kv_store_ref"]


@triton.jit
def _kv_store_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv_kv,  # between the K and V halves of the cache
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    num_kv_heads,
    head_dim,
    block_size,
    inv_k_scale,
    inv_v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program stores BLOCK_H heads of one token's K and V (grid: tokens x head tiles)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    t64 = t.to(tl.int64)
    src_k = key_ptr + t64 * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + t64 * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    k = quantize_kv(tl.load(src_k, mask=mask).to(tl.float32), inv_k_scale, QUANT)
    v = quantize_kv(tl.load(src_v, mask=mask).to(tl.float32), inv_v_scale, QUANT)

    # int64 from here on: block_id * stride_kv_block overflows int32 for pools past 2^31 elements.
    block = slot // block_size
    offset = slot % block_size
    dst = kv_ptr + block * stride_kv_block + offset * stride_kv_tok + heads[:, None] * stride_kv_head + dims[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def kv_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    inv_k_scale: float = 1.0,
    inv_v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` into ``kv`` at ``slot_mapping [T]``.

    ``kv`` is one layer's cache ``[2, num_blocks, block_size, kv_heads, head_dim]`` and is
    modified in place; values are cast to its dtype, an 8-bit one's first multiplied by
    ``inv_k_scale`` / ``inv_v_scale`` and rounded (:func:`._common.quantize_kv`). Negative
    slots are skipped.
    """
    _, block_size, kv_heads, head_dim = check_kv_cache(kv)
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != (kv_heads, head_dim):
        raise ValueError(f"key/value must be [T, {kv_heads}, {head_dim}], got {tuple(key.shape)}, {tuple(value.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError("slot_mapping must be [T] with one slot per token")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key = last_dim_contiguous(key)
    value = last_dim_contiguous(value)
    block_d = next_pow2(head_dim)
    # Keep a program's tile near 2K elements: enough bytes in flight per SM, few registers.
    block_h = min(next_pow2(kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, cdiv(kv_heads, block_h))
    _kv_store_kernel[grid](
        key,
        value,
        kv,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        kv_heads,
        head_dim,
        block_size,
        inv_k_scale,
        inv_v_scale,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANT=quant_mode(kv.dtype),
        num_warps=4,
    )


def kv_store_ref(key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Reference: return a float32 copy of ``kv`` with the tokens written slot by slot."""
    out = kv.detach().to(torch.float32).clone()
    block_size = kv.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        out[0, slot // block_size, slot % block_size] = key[t].to(torch.float32)
        out[1, slot // block_size, slot % block_size] = value[t].to(torch.float32)
    return out
