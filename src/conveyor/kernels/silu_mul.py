"""SiLU-and-multiply: the gated MLP's activation in one pass.

The fused gate/up projection gives ``[T, 2 * intermediate]`` with the gate in the first half
and the up projection in the second. Unfused, ``silu(gate) * up`` is two kernels and a
``[T, intermediate]`` temporary; here one program per (token, column tile) reads both halves
once and writes the product. Rounding follows the unfused form: ``silu`` is computed in float32
and rounded to the input dtype, then multiplied by ``up`` and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import cdiv, next_pow2

__all__ = ["silu_mul_triton", "silu_mul_ref"]

#: Columns per program: large enough to keep loads wide, small enough for many programs at T=1.
BLOCK_COLS = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` as a new ``[T, I]`` tensor of the input dtype.

    Rows of ``gate_up`` may be strided; its last dim must be contiguous.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * I] with a contiguous last dim, got {tuple(gate_up.shape)}")
    width = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] == 0:
        return out
    block = min(BLOCK_COLS, next_pow2(width))
    _silu_mul_kernel[(gate_up.shape[0], cdiv(width, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block, num_warps=4
    )
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference: float32 result, rounded to the input dtype where the unfused form rounds."""
    dtype = gate_up.dtype
    gate, up = gate_up.float().chunk(2, dim=-1)
    return ((gate * torch.sigmoid(gate)).to(dtype).float() * up).to(dtype).float()
