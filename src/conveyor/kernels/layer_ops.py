"""The decoder layer's elementwise and normalization steps and its experts, one function each
for every device.

The model calls these and never branches on the device itself: on CUDA they launch the fused
Triton kernels (:mod:`.rms_norm`, :mod:`.silu_mul`, :mod:`.fused_moe`); elsewhere they run torch's own ops with the
fewest operators that keep the reference's rounding order (each torch operator on a CPU costs a
dispatch and usually an allocation, which a small decode batch pays per layer). Both paths give
the same numbers up to reduction order.

The Triton modules are imported on the first CUDA call, never at import time, so importing the
model neither imports Triton nor fixes ``TRITON_INTERPRET`` (see :mod:`conveyor.kernels`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["add_rms_norm", "invariant_linear", "moe_experts", "silu_and_mul", "softmax_rows", "uses_triton"]


def _use_triton(x: torch.Tensor) -> bool:
    """Whether ``x``'s op runs the Triton kernel: on CUDA tensors (tests also force it on CPU
    tensors, with the kernels interpreted)."""
    return x.is_cuda


def uses_triton(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` run the Triton kernels (for callers outside this module that pick a
    rule by it: batch-invariant mode's matmul)."""
    return _use_triton(x)


@functools.cache
def _triton_module(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(f"conveyor.kernels.{name}")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` over the last dim.

    With a ``residual`` (same shape and dtype as ``x``, hidden dim contiguous), the sum is
    written into it in place and it is returned second: the residual stream of a pre-norm
    decoder is one buffer updated per sublayer. Without one, ``x`` is normalized and returned
    second. The norm runs in float32 and is rounded to ``x``'s dtype before the weight
    multiply, as the reference implementation does.
    """
    if residual is not None:
        if _use_triton(x):
            return _triton_module("rms_norm").add_rms_norm_triton(x, residual, weight, eps)
        x = residual.add_(x)
    elif _use_triton(x):
        flat = x.reshape(-1, x.shape[-1])
        return _triton_module("rms_norm").add_rms_norm_triton(flat, None, weight, eps)[0].view(x.shape), x
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps), x
    # Half precision: torch's rms_norm rounds after the weight multiply; the reference rounds
    # the normed value first and multiplies in the input dtype.
    return weight * F.rms_norm(x, weight.shape, None, eps), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[..., 2 * I]`` (gate first), shape ``[..., I]``.

    The CPU path computes in place in the gate half of ``gate_up`` and returns that (strided)
    view, so ``gate_up`` must be a temporary the caller does not read again.
    """
    if _use_triton(gate_up):
        return _triton_module("silu_mul").silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor | Sequence[Any],
    w2: torch.Tensor | Sequence[Any],
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """``sum_j weights[t, j] * w2[e] (silu(gate_e x_t) * up_e x_t)`` with ``e = experts[t, j]``,
    ``[T, H]`` in ``x``'s dtype: ``w13`` ``[E, 2I, H]`` stacks each expert's gate over its up
    rows, ``w2`` ``[E, H, I]``; an id outside ``0 .. E-1`` (another rank's expert) adds nothing.
    On the CPU ``w13`` and ``w2`` may instead be sequences of per-expert quantized methods (their
    ``apply(x, bias)``: :mod:`conveyor.worker.quantization.methods`), the same loop calling them.

    On CUDA the fused kernels (:func:`conveyor.kernels.fused_moe.fused_moe_triton`: no host
    sync, so a CUDA graph captures it). Elsewhere the ``T * k`` (token, expert) pairs are
    sorted by expert and each active expert runs one matmul pair over its group of tokens (a
    loop over experts, never over tokens; the group sizes are read on the host), the rows gathered
    once, each group's output written in place, weighted and scattered back once.
    """
    if isinstance(w13, torch.Tensor) and _use_triton(x):
        return _triton_module("fused_moe").fused_moe_triton(x, w13, w2, weights, experts)
    num_experts, top_k = len(w13), experts.shape[1]
    flat = experts.flatten()
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # elsewhere: a last group, dropped
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    held = sum(counts)
    order = order[:held]
    tokens = order // top_k
    grouped = x[tokens]  # the pairs' rows, grouped by expert
    outputs = torch.empty_like(grouped)
    for gate_up, down, rows, out in zip(w13, w2, grouped.split(counts), outputs.split(counts)):
        if not rows.shape[0]:
            continue
        if isinstance(gate_up, torch.Tensor):
            torch.mm(silu_and_mul(F.linear(rows, gate_up)), down.t(), out=out)
        else:  # quantized methods (their kernels, :mod:`conveyor.worker.quantization.methods`)
            out.copy_(down.apply(silu_and_mul(gate_up.apply(rows, None)), None))
    outputs.mul_(weights.flatten()[order].to(x.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, tokens, outputs)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x weight^T + bias`` through the batch-invariant Triton matmul
    (:mod:`.invariant_matmul`): batch-invariant mode's projections on CUDA. The CPU has its own
    rule (rows padded to a tile, :func:`conveyor.worker.models.layers.linear`)."""
    return _triton_module("invariant_matmul").invariant_linear(x, weight, bias)


def softmax_rows(x: torch.Tensor, *, log: bool = False, invariant: bool = False) -> torch.Tensor:
    """float32 softmax (``log``: log-softmax) of each row of ``x`` ``[N, V]``. ``invariant``
    (batch-invariant mode) on CUDA: the Triton kernel of :mod:`.invariant_softmax`, whose order
    of additions is fixed by the row's length; otherwise, and on the CPU, torch's (per row there)."""
    if invariant and _use_triton(x):
        return _triton_module("invariant_softmax").row_softmax(x, log)
    x = x.float()
    return x.log_softmax(dim=-1) if log else x.softmax(dim=-1)
