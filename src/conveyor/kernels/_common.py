"""Helpers shared by the Triton kernels: tile sizing, the dot that stays exact where it must,
and the checks every launch wrapper makes on a paged KV cache layer.

The KV cache layout is fixed by the worker: one tensor per layer,
``kv[2, num_blocks, block_size, num_kv_heads, head_dim]`` with index 0 = K and 1 = V.
Token position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: Element types the kernels accept. Accumulation is always float32.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``).

    Read at launch time, not import time, so tests can set the variable in a conftest.
    """
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older Triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch wrappers. Plain Python on purpose: ``triton.cdiv`` is a
    ``constexpr_function`` whose host call unwraps every argument (microseconds per call, paid
    on every launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1); tile extents must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether tile matmuls should run on float32 operands with IEEE precision.

    True for float32 inputs, so a GPU does not silently use TF32 (which would miss the 1e-3
    tolerance), and always under the interpreter, whose ``tl.dot`` multiplies the raw uint16
    bit patterns of bfloat16 tensors instead of their values (checked with Triton 3.9).
    float16/bfloat16 on a GPU keep tensor-core dots with float32 accumulation.
    """
    return dtype == torch.float32 or interpreting()


@triton.jit
def tile_dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` with a float32 result; see :func:`upcast_dots` for when operands are upcast."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def attend_paged_span(
    q,
    q_pos,
    kv_ptr,
    kv_head,
    block_table_ptr,
    b,
    stride_bt,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_kv_kv,
    offs_d,
    d_mask,
    kv_start,
    kv_end,
    qk_scale_log2,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax attention of the query tile ``q`` ``[BLOCK_M, BLOCK_D]`` (row i at position
    ``q_pos[i]``) over positions ``kv_start .. kv_end`` of sequence ``b``'s paged K/V, causal and
    with the sliding ``window`` when ``USE_WINDOW``: the tile loop the decode (split-K) and the
    extend kernels share. Returns ``(acc, l, m)``: the unnormalized output, the softmax
    denominators and the running maxima (base 2). A row that sees nothing in a tile (a window
    that starts later for it, a causal end before the tile) is measured against 0, never
    ``-inf - -inf``."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    v_base = k_base + stride_kv_kv
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block_ids = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        tok = block_ids * stride_kv_block + (offs_n % PAGE) * stride_kv_tok
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tile_dot(q, tl.trans(k), UPCAST) * qk_scale_log2
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


def check_kv_cache(kv: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate one layer's cache and return ``(num_blocks, block_size, kv_heads, head_dim)``.

    Kernels address the cache through its strides, but the innermost (head_dim) stride must be
    1 so a head's row is one contiguous, vectorizable load.
    """
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise ValueError(
            f"kv cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv.shape)}"
        )
    if kv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported kv cache dtype {kv.dtype}")
    if kv.stride(-1) != 1:
        raise ValueError("kv cache head_dim must be contiguous (stride 1)")
    _, num_blocks, block_size, kv_heads, head_dim = kv.shape
    return num_blocks, block_size, kv_heads, head_dim


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` itself when its last dim has stride 1 (slices of a fused QKV output keep
    their other strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
