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


def _empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``[out_features, in_features]``, as checkpoints store it."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = _empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty_parameter(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
    matters for half-precision results)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the pre-norm residual stream in one call."""
        summed = x + residual
        return self.forward(summed), summed


class SiluGatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[2*intermediate, hidden]`` matmul."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` ``[T, H, D]`` and ``key`` ``[T, H_kv, D]`` by the angles of ``positions`` ``[T]``."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)
