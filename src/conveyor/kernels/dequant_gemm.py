"""Dequantize-GEMM: ``y = x W^T`` with ``W`` held as group-wise int4 or int8 codes.

``W[n, k] = scales[n, k // G] * code[n, k] + offsets[n, k // G]``. int4 codes are packed two
per byte along ``k`` (the even column in the low nibble), int8 codes one per byte (signed).
Each program owns a ``BLOCK_M x BLOCK_N`` output tile and walks ``k``: it reads the codes,
their scales and offsets, forms the weight tile in registers and dots it with the activation
tile, so the weights cross memory at 4 or 8 bits; float32 accumulation, the result in ``x``'s
dtype. Decode (``M`` of a few rows) and prefill share the kernel; only the M tile differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import cdiv, next_pow2, tile_dot, upcast_dots

__all__ = ["dequant_gemm", "dequant_gemm_ref", "pack_int4"]


@triton.jit
def _dequant_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, offsets_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_cn, stride_sn, stride_om, group_size,
    BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w_mask = k_mask[:, None] & col_mask[None, :]
        if BITS == 4:
            packed = tl.load(codes_ptr + cols[None, :] * stride_cn + (ks // 2)[:, None], mask=w_mask, other=0)
            codes = ((packed.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 0xF).to(tl.float32)
        else:
            codes = tl.load(codes_ptr + cols[None, :] * stride_cn + ks[:, None], mask=w_mask, other=0).to(tl.float32)
        groups = cols[None, :] * stride_sn + (ks // group_size)[:, None]
        w = codes * tl.load(scales_ptr + groups, mask=w_mask, other=0.0)
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + groups, mask=w_mask, other=0.0)
        acc += tile_dot(x, w.to(x.dtype), UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def dequant_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` times the dequantized ``[N, K]`` weight, transposed, plus ``bias``.

    ``codes``: ``[N, K // 2]`` uint8 (:func:`pack_int4`) for 4 bits, ``[N, K]`` int8 for 8;
    ``scales`` / ``offsets``: float32 ``[N, K // group_size]``."""
    if bits not in (4, 8):
        raise ValueError(f"dequant_gemm takes 4 or 8 bits, got {bits}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    M, K = x.shape
    N = codes.shape[0]
    if K % group_size or tuple(scales.shape) != (N, K // group_size):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit a [{N}, {K}] weight in groups of {group_size}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m = min(64, max(16, next_pow2(M)))
    block_n, block_k = 64, 32
    grid = (cdiv(M, block_m), cdiv(N, block_n))
    _dequant_gemm_kernel[grid](
        x, codes, scales, offsets if offsets is not None else scales, bias if bias is not None else scales, out,
        M, N, K, x.stride(0), codes.stride(0), scales.stride(0), out.stride(0), group_size,
        BITS=bits, HAS_OFFSETS=offsets is not None, HAS_BIAS=bias is not None, UPCAST=upcast_dots(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` codes in 0..15 -> ``[N, K // 2]`` bytes, column ``2j`` in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def dequant_gemm_ref(x, codes, scales, offsets, bits, group_size, bias=None) -> torch.Tensor:
    """float32 reference: unpack, dequantize by the definition, ``F.linear``."""
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(1)
    weight = codes.float() * scales.repeat_interleave(group_size, dim=1)
    if offsets is not None:
        weight += offsets.repeat_interleave(group_size, dim=1)
    return torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())
