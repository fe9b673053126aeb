"""Residual add + RMSNorm in one pass over the hidden state.

A pre-norm decoder adds each sublayer's output to the residual stream and normalizes the sum
before the next sublayer. Unfused that is an add, a square, a mean, an rsqrt, two multiplies and
two casts: seven kernels that each read and write the whole ``[T, hidden]`` activation. Here one
program per token row reads ``x`` and ``residual`` once, writes the sum back into ``residual``
and the normalized row into a new tensor.

Rounding follows the reference implementation (HF's ``LlamaRMSNorm``) step by step, so half-
precision results agree with it to the reduction order: the sum is rounded to the input dtype
(``x + residual`` in that dtype), the norm is computed in float32 and rounded to the input dtype,
and only then multiplied by the weight (one more rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import next_pow2

__all__ = ["add_rms_norm_triton", "add_rms_norm_ref"]


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program normalizes one row; with HAS_RESIDUAL it first adds the residual row and
    stores the sum into it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    # About 8 elements per thread in flight: 4 warps for hidden 1-4K, 8 to 16 beyond.
    return max(1, min(16, block // 256))


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` over the last dim of ``[T, hidden]``.

    With a ``residual``, the sum is written into ``residual`` (in place) and that tensor is
    returned second; without one, ``x`` is normalized and returned second unchanged. Rows may
    be strided; the hidden dim of ``x`` and ``residual`` must be contiguous, as a matmul output is.
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"x [T, hidden], residual like x, weight [hidden]; got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or (residual is not None and (residual.stride(1) != 1 or residual.dtype != x.dtype)):
        raise ValueError("x and residual need a contiguous hidden dim and one dtype")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0] == 0:
        return out, x if residual is None else residual
    block = next_pow2(x.shape[1])
    has_residual = residual is not None
    _add_rms_norm_kernel[(x.shape[0],)](
        x,
        residual if has_residual else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if has_residual else 0,
        out.stride(0),
        x.shape[1],
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out, residual if has_residual else x


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: float32 ``(normed, summed)``, computed in float32 and rounded to the input
    dtype at the points the model rounds (sum, norm, product); leaves its inputs unchanged."""
    dtype = x.dtype
    summed = x.float() if residual is None else (x.float() + residual.float()).to(dtype).float()
    normed = (summed * torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype).float()
    return (normed * weight.float()).to(dtype).float(), summed
