"""Building blocks shared by the decoder models, written for flattened ``[T, ...]`` token batches.

Parameters are created uninitialised (``torch.empty``) on their final device and dtype:
the loader overwrites every one of them, so random initialisation would only cost time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.layer_ops import add_rms_norm, invariant_linear, silu_and_mul, uses_triton
from conveyor.worker.parallel import TensorParallel, all_reduce_


def _empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``[out_features, in_features]``, as checkpoints store it.

    ``lora``: the stacked adapter weights attached by :class:`conveyor.worker.lora.LoraManager`
    (None without adapters); it adds each token's adapter delta to the output."""

    lora = None
    #: ``weight`` in oneDNN's layout for the CPU matmul (:func:`pack_cpu_weights`), or None.
    packed = None
    #: The quantized weight (:mod:`conveyor.worker.quantization`), in place of ``weight``
    #: (None then), and its parts while the loader reads them.
    quant = None
    pending = None
    #: Rows are padded to a multiple of this before the matmul (batch-invariant mode,
    #: :mod:`conveyor.worker.batch_invariant`); 1: no padding. On CUDA any value > 1 runs the
    #: batch-invariant Triton matmul instead (its row tile is the kernel's own).
    row_tile = 1

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_parameter(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return y if self.lora is None else self.lora.add_delta(x, y)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias``, through the quantized or packed weight when there is one."""
        if self.quant is not None:
            return self.quant.apply(x, bias)
        return linear(x, self.weight, bias, self.packed, self.row_tile)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    row_tile: int = 1,
) -> torch.Tensor:
    """``x weight^T + bias``: with ``packed`` (``weight`` reordered by :func:`pack_cpu_weight`)
    oneDNN's matmul on it, else ``F.linear``. On the CPU, MKL's float32 GEMM that F.linear
    calls runs the decode step's few rows 1.4-2x slower than oneDNN on a packed weight
    (docs/benchmarks.md, "CPU: where the time goes"). ``row_tile`` > 1 pads ``x``'s rows
    (zeros) to a multiple of it, so the GEMM never runs the row counts whose kernel choice
    changes a row's bits (batch-invariant mode); on CUDA it runs the batch-invariant Triton
    matmul (:func:`~conveyor.kernels.layer_ops.invariant_linear`) instead."""
    rows = x.shape[0]
    if row_tile > 1 and uses_triton(x):
        return invariant_linear(x, weight, bias)
    if row_tile > 1 and rows % row_tile:
        x = torch.cat([x, x.new_zeros(row_tile - rows % row_tile, *x.shape[1:])])
        return linear(x, weight, bias, packed)[:rows]
    if packed is None or rows == 0:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


#: The rows oneDNN lays a packed weight out for (any count runs on it). Measured on the real
#: model's decode step, one thread: against no hint, 16 ran batch 1 1.23-1.39x as fast and
#: batch 8 and 32 alike; 1 was slower at batch 8, 8 and 32 no better than 16.
PACKED_ROWS_HINT = 16


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` reordered for oneDNN's matmul, where that pays: float32 on a CPU
    with oneDNN (None elsewhere: CUDA, other dtypes)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS_HINT)


def pack_cpu_weights(model: nn.Module) -> None:
    """Give every :class:`Linear` of ``model`` its packed weight (:func:`pack_cpu_weight`),
    once its weights are loaded. The dense ``weight`` stays: the loader, LoRA and the tied
    embedding read it; the packed copy is what the forward reads."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            module.packed = pack_cpu_weight(module.weight)


class RowParallelLinear(Linear):
    """A :class:`Linear` whose input features are split across the tensor-parallel ranks:
    ``weight`` holds this rank's ``in_features`` columns, each rank's product is partial, and
    one all-reduce sums them into the full output on every rank.

    The bias (replicated) is added by rank 0 alone, so the sum holds it exactly once; at
    size 1 this is the plain :class:`Linear`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tensor_parallel = tensor_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tensor_parallel.rank == 0 else None)
        if self.lora is not None:  # this rank's partial delta (A split on the input), summed with y
            y = self.lora.add_delta(x, y)
        return all_reduce_(y, self.tensor_parallel)


class Embedding(nn.Module):
    """Token id -> row of ``weight`` ``[vocab_size, hidden_size]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _empty_parameter(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 and cast back
    before the weight is applied (the order the reference implementation uses, which
    matters for half-precision results). One fused kernel on CUDA, torch's ``rms_norm``
    elsewhere (:func:`conveyor.kernels.layer_ops.add_rms_norm`)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the pre-norm residual stream in one call.
        The sum is written into ``residual`` (in place) and returned as the new stream."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of ``gate_up`` ``[..., 2 * I]`` (gate first): GeGLU, as
    transformers' ``gelu_pytorch_tanh``; torch ops on every device (no fused kernel yet)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


#: Gated-MLP activation (ModelConfig.hidden_act) -> ``act(gate) * up`` of the fused projection.
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one ``[2*intermediate, hidden]``
    matmul; ``activation`` one of :data:`GATED_ACTIVATIONS` (SwiGLU: ``silu``, GeGLU:
    ``gelu_pytorch_tanh``).

    Tensor-parallel: ``intermediate_size`` is this rank's share of the features (gate/up
    column-parallel, their rows; down row-parallel, its columns, summed by one all-reduce).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.act_and_mul = GATED_ACTIVATIONS[activation]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype, device, tensor_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float64 ``[head_dim // 2]`` rotation frequencies, after the checkpoint's rope scaling.

    ``linear`` divides every frequency by ``factor`` (positions stretched uniformly).
    ``llama3`` leaves high frequencies (wavelength under ``original / high_freq_factor``)
    alone, divides low ones (wavelength over ``original / low_freq_factor``) by ``factor``,
    and blends linearly in wavelength-ratio between the two bands.
    """
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inverse
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inverse / factor
    if scaling["rope_type"] == "llama3":
        original = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelength = 2 * math.pi / inverse
        # Within the medium band: 0 at its low-frequency edge, 1 at its high-frequency edge.
        blend = (original / wavelength - low) / (high - low)
        scaled = torch.where(wavelength > original / low, inverse / factor, inverse)
        medium = (wavelength <= original / low) & (wavelength >= original / high)
        return torch.where(medium, (1 - blend) * inverse / factor + blend * inverse, scaled)
    raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout, with cos/sin precomputed for
    every position below ``max_positions``.

    The cache is float32 ``[max_positions, head_dim]`` (cos halves, then sin halves); the
    rotation runs in float32 and is cast back to the input dtype. It is a plain attribute,
    not a buffer, so it is never part of a state dict and never cast to half precision.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inverse = rope_inverse_frequencies(head_dim, theta, scaling)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inverse[None, :]
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=device, dtype=torch.float32)

    def forward(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """``heads`` ``[T, H, D]`` (a layer's query and key heads side by side: one rotation
        for both) rotated by the angles of ``positions`` ``[T]``, a new tensor."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(heads, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[first * cos - second * sin, second * cos + first * sin]`` in float32, cast back; a
    multiply-add per half (``addcmul``) keeps it at five operators."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = [torch.addcmul(first * cos, second, sin, value=-1), torch.addcmul(second * cos, first, sin)]
    return torch.cat(rotated, dim=-1).to(x.dtype)
