"""Helpers shared by the Triton kernels: tile sizing, the dot that stays exact where it must, the
8-bit KV cache's store rule, the checks every launch wrapper makes on a paged KV cache layer, and what the two paged
attention kernels (decode, extend) share: their tile loop and output store, their wrappers'
checks and the launch arguments both declare alike.

The KV cache layout is fixed by the worker: one tensor per layer,
``kv[2, num_blocks, block_size, num_kv_heads, head_dim]`` with index 0 = K and 1 = V.
Token position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: Element types the kernels accept. Accumulation is always float32.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: 8-bit KV cache dtypes, by the ``QUANT`` constant of the kernels that store and read them
#: (0: a float cache, values as they are).
QUANT_DTYPES = {torch.int8: 1, torch.float8_e4m3fn: 2}
#: A KV cache layer's element types: the float ones, and 8-bit ones of scaled values.
KV_CACHE_DTYPES = SUPPORTED_DTYPES + tuple(QUANT_DTYPES)
#: log2(e): the attention kernels exponentiate with exp2, so their wrappers pass scale * LOG2E.
LOG2E = 1.4426950408889634


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


def quant_mode(dtype: torch.dtype) -> int:
    """The ``QUANT`` constant for a cache of ``dtype`` (:data:`QUANT_DTYPES`; 0 for float)."""
    return QUANT_DTYPES.get(dtype, 0)


@triton.jit
def quantize_kv(x, inv_scale, QUANT: tl.constexpr):
    """float32 ``x`` as an 8-bit cache stores it, still as float32 (the cast to the cache's
    type is then exact): ``x * inv_scale`` clamped to the type's range and rounded to nearest,
    ties to even (``QUANT`` 1: int8, to integers; 2: float8 e4m3fn, to 3 mantissa bits, or to
    multiples of 2**-9 below its smallest normal 2**-6). The rounding is done here, in float32
    arithmetic, rather than by the cast: Triton's interpreter casts float32 to float8 with the
    wrong exponent where rounding carries into it, and flushes subnormals. ``QUANT`` 0: ``x``."""
    if QUANT == 0:
        return x
    x = x * inv_scale
    if QUANT == 1:
        x = tl.minimum(tl.maximum(x, -127.0), 127.0)
        return (x + 12582912.0) - 12582912.0  # 1.5 * 2**23: float32 addition rounds to integers
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    # Round the float32 mantissa to its top 3 bits, to nearest even (a carry moves the exponent).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    tiny = (x + 24576.0) - 24576.0  # 1.5 * 2**14: float32 addition rounds to multiples of 2**-9
    return tl.where(tl.abs(x) < 0.015625, tiny, normal)


@triton.jit
def _as_query(x, q):
    """A tile of an 8-bit cache in the query's dtype (through float32: Triton's interpreter
    casts int8 to bfloat16 as bits); a float cache's tile as it is (its dtype is the query's)."""
    if x.dtype != q.dtype:
        x = x.to(tl.float32).to(q.dtype)
    return x


@triton.jit
def attend_paged_span(
    q_rows,
    row_mask,
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
    head_dim,
    kv_start,
    kv_end,
    qk_scale_log2,
    window,
    v_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax attention of a tile of ``BLOCK_M`` query rows (row i read from the pointer
    ``q_rows[i]`` where ``row_mask[i]``, at position ``q_pos[i]``; ``BLOCK_M`` is their length)
    over positions ``kv_start .. kv_end`` of sequence ``b``'s paged K/V, causal and with the
    sliding ``window`` when ``USE_WINDOW``: what the decode (split-K) and the extend kernels
    share, from the query load to the normalized output. Returns ``(o, lse)``: the output rows
    ``[BLOCK_M, BLOCK_D]`` and their log-sum-exp (base 2), float32; a row that sees nothing gets
    0 and -inf. A row that sees nothing in a tile (a window that starts later for it, a causal
    end before the tile) is measured against 0, never ``-inf - -inf``.

    An 8-bit cache's keys and values are converted to the query's dtype as they are loaded;
    its key scale is in ``qk_scale_log2`` and its value scale ``v_scale`` multiplies the
    output (1 for a float cache)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full(q_pos.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(q_pos.shape, tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    v_base = k_base + stride_kv_kv
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block_ids = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        tok = block_ids * stride_kv_block + (offs_n % PAGE) * stride_kv_tok
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _as_query(tl.load(k_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0), q)
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
        v = _as_query(tl.load(v_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0), q)
        acc = acc * alpha[:, None] + tile_dot(p.to(q.dtype), v, UPCAST)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    return acc * (v_scale / l_safe)[:, None], m_i + tl.log2(l_safe)


@triton.jit
def store_rows(row_ptrs, row_mask, x, head_dim, BLOCK_D: tl.constexpr):
    """Store the rows of the float32 tile ``x`` ``[BLOCK_M, BLOCK_D]`` (their first
    ``head_dim`` elements, where ``row_mask``) at the pointers ``row_ptrs``, cast to their type."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (offs_d < head_dim)[None, :]
    tl.store(row_ptrs[:, None] + offs_d[None, :], x.to(row_ptrs.dtype.element_ty), mask=mask)


def check_kv_cache(kv: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate one layer's cache and return ``(num_blocks, block_size, kv_heads, head_dim)``.

    Kernels address the cache through its strides, but the innermost (head_dim) stride must be
    1 so a head's row is one contiguous, vectorizable load.
    """
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise ValueError(f"kv cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv.shape)}")
    if kv.dtype not in KV_CACHE_DTYPES:
        raise TypeError(f"unsupported kv cache dtype {kv.dtype}")
    if kv.stride(-1) != 1:
        raise ValueError("kv cache head_dim must be contiguous (stride 1)")
    _, num_blocks, block_size, kv_heads, head_dim = kv.shape
    return num_blocks, block_size, kv_heads, head_dim


class PagedAttentionInputs(NamedTuple):
    """A paged attention launch's inputs after the checks the decode and the extend wrappers
    share: ``query`` ``[tokens, heads, head_dim]`` with head_dim contiguous and kv's dtype,
    ``block_tables`` ``[B, max_blocks]`` with contiguous rows, ``out`` shaped like ``query`` with
    a contiguous last dim (allocated when not given). Each wrapper still checks its batch layout.
    A NamedTuple: made on every launch, where a frozen dataclass's init costs a microsecond."""

    query: torch.Tensor
    kv: torch.Tensor
    block_tables: torch.Tensor
    out: torch.Tensor
    block_size: int
    num_kv_heads: int
    sliding_window: int | None

    def strides_scale_window(self, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[int | float, ...]:
        """The arguments both attention kernels declare after their pointers, in their order:
        query and output token/head strides; ``stride_kv_kv, stride_kv_block, stride_kv_tok,
        stride_kv_head, stride_bt``; ``qk_scale_log2`` (exp2 softmax, an 8-bit cache's key
        scale ``k_scale`` in it); ``window`` (0: none); ``v_scale``, its value scale."""
        return (
            *self.query.stride()[:2],
            *self.out.stride()[:2],
            *self.kv.stride()[:4],
            self.block_tables.stride(0),
            scale * k_scale * LOG2E,
            self.sliding_window or 0,
            v_scale,
        )

    @property
    def constants(self) -> dict[str, int | bool]:
        """The compile-time constants both attention kernels take alike (their tiles differ);
        the dots run in the query's dtype (an 8-bit cache's tiles are converted to it)."""
        use_window = self.sliding_window is not None
        return {"PAGE": self.block_size, "USE_WINDOW": use_window, "UPCAST": upcast_dots(self.query.dtype)}


def check_paged_attention(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    sliding_window: int | None,
    out: torch.Tensor | None,
) -> PagedAttentionInputs:
    """Validate what every paged attention wrapper takes alike; raise ``ValueError`` /
    ``TypeError`` naming the first problem."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [tokens, heads, {head_dim}], got {tuple(query.shape)}")
    num_heads = query.shape[1]
    if kv.dtype in QUANT_DTYPES:
        if query.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"query dtype {query.dtype} is not one of {SUPPORTED_DTYPES}")
    elif query.dtype != kv.dtype:
        raise TypeError(f"query dtype {query.dtype} differs from the kv cache's {kv.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {num_kv_heads}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError("sliding_window must be positive")
    query = last_dim_contiguous(query)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError("out must match query's shape with a contiguous last dim")
    return PagedAttentionInputs(query, kv, block_tables, out, block_size, num_kv_heads, sliding_window)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` itself when its last dim has stride 1 (slices of a fused QKV output keep
    their other strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
