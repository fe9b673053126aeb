"""Batch-invariant row softmax and log-softmax for ``--batch-invariant`` on CUDA (the sampler's
distributions and log-probabilities).

One program per row walks the row in fixed ``BLOCK`` column chunks from column 0: a first
pass keeps the running maximum and the rescaled sum of exponentials, a second writes each
entry. The order of every addition is fixed by the row's length alone, never by how many
rows the launch has. Output float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "row_softmax", "row_softmax_ref"]

#: Columns per chunk; part of the mode's numerics (the order of the sum).
BLOCK = 1024


@triton.jit
def _row_softmax_kernel(x_ptr, out_ptr, n, stride_x, stride_out, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for c0 in range(0, n, BLOCK):
        x = tl.load(x_row + c0 + offs, mask=c0 + offs < n, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m, tl.max(x, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2(m - m_ref) + tl.sum(tl.exp2(x - m_ref), 0)
        m = m_new
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log2(s)
    for c0 in range(0, n, BLOCK):
        mask = c0 + offs < n
        x = tl.load(x_row + c0 + offs, mask=mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        if LOG:
            y = (x - m_ref - log_s) * 0.6931471805599453
        else:
            y = tl.exp2(x - m_ref - log_s)
        tl.store(out_ptr + row * stride_out + c0 + offs, y, mask=mask)


def row_softmax(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """float32 softmax (``log``: log-softmax) of each row of ``x`` ``[N, V]``."""
    if x.dim() != 2:
        raise ValueError(f"x must be [N, V], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        _row_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), LOG=log, BLOCK=BLOCK)
    return out


def row_softmax_ref(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """Reference: torch's float32 (log-)softmax."""
    return x.float().log_softmax(-1) if log else x.float().softmax(-1)
