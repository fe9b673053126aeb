"""Turning a model's Linear layers into quantized ones and filling them while the loader reads.

:func:`quantize_linears` runs after the model is built and before any weight is read: each
:class:`~conveyor.worker.models.layers.Linear` drops its (never touched) float weight and gets
a :class:`PendingWeight` instead. The loader hands each checkpoint tensor's part to
:func:`load_part` as it reaches it (a float slice, or a :class:`.tensors.QuantizedTensor` when
the checkpoint is already quantized); a float part is quantized at once, so no float copy of
more than one tensor ever exists, and once a layer's rows are all in, its parts become the
method's kernel layout (:mod:`.methods`) and the staging is dropped.

Schemes: ``int8`` / ``int4`` / ``fp8`` quantize a float checkpoint; ``checkpoint`` keeps a GGUF
file's blocks (Q4_0/Q4_1 and 4-bit k-quants as int4, the rest as int8), and GPTQ/AWQ's
groups as int4. The LM head is int8
under every scheme (it is the largest matmul and the most sensitive one).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.worker.quantization.methods import CPU_INT4_GROUPS, Fp8Weights, Int4Weights, Int8Weights, QuantizedWeights
from conveyor.worker.quantization.tensors import (
    Fp8Tensor,
    QuantizedTensor,
    as_int8_per_channel,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)  # fmt: skip

#: What --quantization takes for a float checkpoint; ``checkpoint`` (keep what a quantized
#: checkpoint holds) is what ``auto`` means for a quantized GGUF file or a GPTQ/AWQ one.
SCHEMES = ("none", "int8", "int4", "fp8", "checkpoint")
#: int4's group size when quantizing a float checkpoint (llama.cpp's block, GPTQ's smallest
#: common group); GGUF's blocks are 32 as well.
INT4_GROUP_SIZE = 32
GGUF_BLOCK = 32


class PendingWeight:
    """The parts of one Linear's weight read so far (rows ``start:end`` each)."""

    def __init__(self, scheme: str, out_features: int, in_features: int) -> None:
        self.scheme, self.out_features, self.in_features = scheme, out_features, in_features
        self.parts: list[tuple[int, QuantizedTensor | Fp8Tensor]] = []
        self.rows = 0

    def add(self, start: int, part: torch.Tensor | QuantizedTensor | Fp8Tensor) -> None:
        if isinstance(part, torch.Tensor):
            if self.scheme == "fp8":
                part = quantize_fp8(part)
            elif self.scheme == "int4":
                part = quantize_int4(part, INT4_GROUP_SIZE)
            else:  # int8, the LM head, and a float tensor inside a quantized GGUF file
                part = quantize_int8(part)
        self.parts.append((start, part))
        self.rows += part.shape[0]

    @property
    def complete(self) -> bool:
        return self.rows == self.out_features

    def build(self, device: torch.device | str) -> QuantizedWeights:
        parts = [part for _, part in sorted(self.parts, key=lambda item: item[0])]
        if any(isinstance(p, Fp8Tensor) for p in parts):  # (a checkpoint's fp8 layers are fp8 throughout)
            return Fp8Weights(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]), device)
        groups = {(p.bits, p.group_size) for p in parts}
        if torch.device(device).type == "cpu" and any(
            p.bits == 4 and p.group_size not in CPU_INT4_GROUPS for p in parts
        ):
            parts = [quantize_int4(p.dequantize(), INT4_GROUP_SIZE) for p in parts]  # groups the CPU kernel lacks
            groups = {(4, INT4_GROUP_SIZE)}
        if len(groups) == 1 and next(iter(groups))[0] == 4:
            return Int4Weights(_concat(parts), device)
        return Int8Weights(_concat([as_int8_per_channel(p) for p in parts]), device)  # mixed parts: int8 per channel


def _concat(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """The parts (of one form) stacked by rows."""
    first = parts[0]
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
    return QuantizedTensor(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), offsets, first.bits, first.group_size
    )


def quantize_linears(model: nn.Module, scheme: str) -> dict[str, nn.Module]:
    """Give every Linear of ``model`` a :class:`PendingWeight` under ``scheme`` (its float
    weight dropped); the result maps each one's weight parameter name to the Linear, for the
    loader. ValueError (naming the layer and the group) when a group would straddle this
    tensor-parallel rank's share of a layer's input features."""
    from conveyor.worker.models.layers import Linear

    if scheme not in SCHEMES:
        raise ValueError(f"--quantization {scheme!r}: use one of {', '.join(SCHEMES)}")
    targets: dict[str, nn.Module] = {}
    if scheme == "none":
        return targets
    group = {"int4": INT4_GROUP_SIZE, "checkpoint": GGUF_BLOCK}.get(scheme)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        head = name == "lm_head"
        if group is not None and not head and module.in_features % group:
            raise ValueError(
                f"--quantization {scheme}: {name} has {module.in_features} input features on this rank, "
                f"not a multiple of the quantization group of {group}; "
                "use another --tensor-parallel-size or --quantization none"
            )
        module.weight = None
        module.pending = PendingWeight("int8" if head else scheme, module.out_features, module.in_features)
        targets[f"{name}.weight"] = module
    model.quantization = scheme
    return targets


def load_part(linear: nn.Module, start: int, part: torch.Tensor | QuantizedTensor, device: torch.device | str) -> None:
    """Add rows ``start:`` of ``linear``'s weight; the last part turns them into its method."""
    linear.pending.add(start, part)
    if linear.pending.complete:
        linear.quant = linear.pending.build(device)
        linear.pending = None
