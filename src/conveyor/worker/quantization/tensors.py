"""The one form every quantized weight passes through on its way into a layer.

A :class:`QuantizedTensor` is group-wise affine integer codes, ``w[r, c] = scales[r, g] *
codes[r, c] + offsets[r, g]`` with ``g = c // group_size``: GGUF blocks (Q4_1 is exactly this,
Q4_0 and Q8_0 with a fixed offset), AWQ/GPTQ groups and our own quantizers all write it, and
each kernel layout (:mod:`.methods`) is built from it, so a format and a kernel never meet
directly. Codes are unpacked (one byte each) and only one weight's worth is alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedTensor:
    """``codes`` ``[rows, cols]`` (int8 for 8 bits, uint8 in 0..15 for 4), ``scales`` and
    ``offsets`` float32 ``[rows, cols // group_size]`` (offsets None: zero)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if cols % self.group_size or tuple(self.scales.shape) != (rows, cols // self.group_size):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} do not fit codes {tuple(self.codes.shape)} "
                f"in groups of {self.group_size}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> QuantizedTensor:
        """The rows (and whole groups of columns) ``index`` names: a tensor-parallel shard."""
        rows = index[0]
        cols = index[1] if len(index) > 1 else slice(None)
        start, stop, _ = cols.indices(self.codes.shape[1])
        if start % self.group_size or stop % self.group_size:
            raise ValueError(f"columns {start}:{stop} split a quantization group of {self.group_size}")
        groups = slice(start // self.group_size, stop // self.group_size)
        offsets = None if self.offsets is None else self.offsets[rows, groups]
        return QuantizedTensor(self.codes[rows, cols], self.scales[rows, groups], offsets, self.bits, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]`` (for requantizing a part and for the tests' references)."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        values = self.codes.float() * scales
        if self.offsets is not None:
            values += self.offsets.repeat_interleave(self.group_size, dim=1)
        return values


@dataclass(frozen=True)
class Fp8Tensor:
    """e4m3 ``values`` ``[rows, cols]`` with float32 ``scales`` ``[rows]`` (``w = scale * value``)."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> Fp8Tensor:
        return Fp8Tensor(self.values[index], self.scales[index[0]])

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


def quantize_fp8(weight: torch.Tensor) -> Fp8Tensor:
    """Per-output-channel e4m3 (each row's largest magnitude at e4m3's largest value)."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return Fp8Tensor((weight / scales[:, None]).to(torch.float8_e4m3fn), scales)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric per-output-channel int8 (codes -127..127, one scale per row)."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    codes = torch.round(weight / scales).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(codes, scales, None, 8, weight.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Asymmetric group-wise int4: each group's range [min, max] mapped onto codes 0..15."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide the {cols} input features")
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    # scale and the CPU kernel's zero (low + 8 scale) held exactly in bfloat16, so the kernel
    # needs no residual call for them (methods._int4_cpu)
    scales = ((high - low) / 15).clamp_min(1e-12).bfloat16().float()
    low = (low + 8 * scales).bfloat16().float() - 8 * scales
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedTensor(codes.reshape(rows, cols), scales, low, 4, group_size)


def as_int8_per_channel(weight: QuantizedTensor) -> QuantizedTensor:
    """``weight`` in the int8 per-channel form (itself when it is one; else dequantized and
    requantized row by row: the CPU int8 kernel has one scale per row)."""
    if weight.bits == 8 and weight.offsets is None and weight.group_size == weight.codes.shape[1]:
        return weight
    return quantize_int8(weight.dequantize())
