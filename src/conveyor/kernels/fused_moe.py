"""Fused mixture-of-experts MLP: every (token, expert) pair of a step in two grouped GEMMs.

A step's ``T`` tokens each pick ``k`` experts: ``T * k`` pairs. :func:`align_by_expert` sorts
the pairs by expert and pads each expert's group to a multiple of ``BLOCK_M``, so every row
block of the sorted list belongs to one expert. The first kernel multiplies each block's
tokens by its expert's fused gate/up weights and writes ``silu(gate) * up`` (SiLU-and-multiply
fused into the GEMM's epilogue, no ``[pairs, 2I]`` temporary); the second multiplies those by
the expert's down weights, scales each row by its router weight and writes it to the pair's
row; the ``k`` rows of a token are then summed (float32) and rounded to the input dtype once.

CUDA graphs: nothing here reads a tensor value on the host. The sorted list has a fixed
capacity for a given ``T`` (``T * k`` pairs plus ``BLOCK_M - 1`` padding for each of at most
``min(E, T * k)`` non-empty groups), the grid covers all of it, and the blocks past the last
group (their expert recorded as ``-1``) return at once; the alignment is sorts, cumsums and
scatters of fixed shapes. So a decode step with MoE layers is captured like a dense one.

Pairs whose expert is outside ``0 .. E-1`` (held by another rank under expert parallelism) are
left out of the sorted list and contribute zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels._common import cdiv, next_pow2, tile_dot, upcast_dots

__all__ = ["align_by_expert", "fused_moe_triton", "fused_moe_ref", "moe_tiles"]


def moe_tiles(pairs: int, num_experts: int, width: int, hidden: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)``: row blocks about the size of an expert's average group
    (16 at decode sizes, so padding wastes little), 64-wide column and reduction tiles (smaller
    for narrow layers; tl.dot needs 16 at least)."""
    per_expert = pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    return block_m, max(16, min(64, next_pow2(width))), max(16, min(64, next_pow2(hidden)))


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_experts)`` of ``experts`` ``[T, k]`` (local expert ids):

    ``sorted_pairs`` int32 ``[capacity]``: flat pair indices ``t * k + j`` grouped by expert,
    each group starting at a multiple of ``block_m``, gaps filled with ``T * k`` (no pair);
    ``block_experts`` int32 ``[capacity / block_m]``: each row block's expert, ``-1`` past the
    last group. Fixed shapes for a given ``T``, no host sync (module docstring)."""
    flat = experts.flatten()
    pairs = flat.numel()
    device = flat.device
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # elsewhere: a group of its own, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    firsts = ends - padded  # each group's first row in the sorted list
    unpadded_firsts = counts.cumsum(0) - counts  # ... and in the plain sort
    sorted_experts, order = torch.sort(flat, stable=True)
    group = sorted_experts.clamp(max=num_experts - 1)
    rank = torch.arange(pairs, device=device) - unpadded_firsts[group]
    capacity = cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    dest = torch.where(sorted_experts < num_experts, firsts[group] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_firsts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_firsts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pairs[:capacity], block_experts


@triton.jit
def _block_rows(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's expert (-1: none) and its block's pairs with their mask."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pairs, pairs < num_pairs


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, top_k, hidden, width,
    stride_x, stride_we, stride_wn, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    expert, pairs, row_mask = _block_rows(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    tokens = pairs // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < width
    weights = w13_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        b_mask = k_mask[:, None] & col_mask[None, :]
        b_gate = tl.load(weights + cols[None, :] * stride_wn + ks[:, None], mask=b_mask, other=0.0)
        b_up = tl.load(weights + (cols[None, :] + width) * stride_wn + ks[:, None], mask=b_mask, other=0.0)
        gate += tile_dot(a, b_gate, UPCAST)
        up += tile_dot(a, b_up, UPCAST)
    # Rounded where the unfused projection and silu_and_mul round.
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(act_ptr + pairs[:, None] * stride_act + cols[None, :], (silu * up).to(dtype), mask=out_mask)


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, router_weights_ptr,
    num_pairs, hidden, width,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    expert, pairs, row_mask = _block_rows(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    weights = w2_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < width
        a = tl.load(
            act_ptr + pairs[:, None] * stride_act + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        b = tl.load(
            weights + cols[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        acc += tile_dot(a, b, UPCAST)
    scale = tl.load(router_weights_ptr + pairs, mask=row_mask, other=0.0)
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], acc * scale[:, None], mask=out_mask)


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """``sum_j weights[t, j] * w2[e] (silu(gate_e x_t) * up_e x_t)`` with ``e = experts[t, j]``,
    ``[T, H]`` in ``x``'s dtype. ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows over up
    rows), ``w2`` ``[E, H, I]``, both with contiguous last dims; ``weights`` ``[T, k]`` (float32
    router weights), ``experts`` ``[T, k]`` local expert ids (others contribute nothing)."""
    tokens, hidden = x.shape
    num_experts, width = w13.shape[0], w13.shape[1] // 2
    top_k = experts.shape[1]
    pairs = tokens * top_k
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return out.view(tokens, hidden).to(x.dtype)
    x = x.contiguous()
    block_m, block_n, block_k = moe_tiles(pairs, num_experts, width, hidden)
    sorted_pairs, block_experts = align_by_expert(experts, num_experts, block_m)
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    blocks = block_experts.shape[0]
    upcast = upcast_dots(x.dtype)
    _gate_up_kernel[(blocks, cdiv(width, block_n))](
        x, w13, act, sorted_pairs, block_experts, pairs, top_k, hidden, width,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
    )  # fmt: skip
    router = weights.to(torch.float32).contiguous()
    _down_kernel[(blocks, cdiv(hidden, block_n))](
        act, w2, out, sorted_pairs, block_experts, router, pairs, hidden, width,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, next_pow2(width))), UPCAST=upcast,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """float32 reference: every expert's MLP on every token, weighted by the router weight the
    token gives it (zero where it did not pick it); the gate/up products, the SiLU and the
    activation rounded to the input dtype where the kernel (and the unfused model) rounds."""
    dtype = x.dtype

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float()

    xf, out = x.float(), torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        gate, up = rounded(xf @ w13[expert].float().T).chunk(2, dim=-1)
        y = rounded(rounded(torch.nn.functional.silu(gate)) * up) @ w2[expert].float().T
        out += (weights.float() * (experts == expert)).sum(dim=1, keepdim=True) * y
    return out
