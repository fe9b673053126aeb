"""Batch-invariant matmul ``y = x W^T + b`` for ``--batch-invariant`` on CUDA.

cuBLAS (what ``F.linear`` calls) picks its kernel, tile and split-K by the shape, so one
token's row comes out with other bits at ``M = 1`` than at ``M = 64``. This kernel has one
configuration for every ``M``: fixed ``BLOCK_M x BLOCK_N`` output tiles, the reduction
dimension walked in ``BLOCK_K`` steps from 0 in one program (no split-K), float32
accumulation. A row's result is then a function of the row and ``W`` alone: the other rows of
the batch only decide which tile it sits in. docs/batch-invariance.md says what this costs
and what a GPU still has to confirm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import SUPPORTED_DTYPES, cdiv, tile_dot, upcast_dots

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "invariant_linear", "linear_ref"]

#: The one tile configuration. Part of the mode's numerics: changing ``BLOCK_K`` changes
#: every result's bits (the others change only speed).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + cols64[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        acc += tile_dot(x, w, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_om + cols64[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x weight^T + bias`` over the last dim of ``x`` (``[..., K]``, ``weight`` ``[N, K]``), in
    ``x``'s dtype, each row's bits independent of the other rows."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] needed; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if (
        x.dtype not in SUPPORTED_DTYPES
        or weight.dtype != x.dtype
        or (bias is not None and bias.shape != weight.shape[:1])
    ):
        raise TypeError(f"x and weight of one dtype among {SUPPORTED_DTYPES}, bias [N]; got {x.dtype}, {weight.dtype}")
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    (m, k), n = flat.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _invariant_matmul_kernel[(cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))](
            flat, weight, bias if bias is not None else flat, out, m, n, k,
            flat.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, UPCAST=upcast_dots(x.dtype),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3,
        )  # fmt: skip
    return out.view(*lead, n)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: float32 ``x weight^T + bias`` of the same (already rounded) inputs."""
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()
