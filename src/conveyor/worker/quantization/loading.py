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
groups as int4. A mixture of experts' stacked experts are quantized the same way on the CPU,
one method per expert (:class:`QuantizedExperts`). The LM head is int8
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


class QuantizedExperts:
    """A sparse layer's stacked expert weight (``w13`` or ``w2``,
    :class:`~conveyor.worker.models.moe.SparseMoe`) kept quantized on the CPU: one method per
    expert, filled by the loader as a Linear is (stack rows ``e * rows ...`` are expert ``e``'s;
    an expert's parts never straddle two experts). ``quant``: the experts' methods, in order,
    once every expert's rows are in."""

    def __init__(self, scheme: str, count: int, rows: int, in_features: int, device: torch.device | str) -> None:
        self.rows, self.in_features, self.device = rows, in_features, device
        self.experts: list[PendingWeight | QuantizedWeights] = [
            PendingWeight(scheme, rows, in_features) for _ in range(count)
        ]
        self.pending = self  # what the loader adds parts to (load_part)
        self.quant: list[QuantizedWeights] | None = None

    def add(self, start: int, part: torch.Tensor | QuantizedTensor) -> None:
        expert, offset = divmod(start, self.rows)
        pending = self.experts[expert]
        assert isinstance(pending, PendingWeight), f"expert {expert}'s rows were already complete"
        pending.add(offset, part)
        if pending.complete:  # built at once: its staged parts are dropped
            self.experts[expert] = pending.build(self.device)

    @property
    def complete(self) -> bool:
        return not any(isinstance(expert, PendingWeight) for expert in self.experts)

    def build(self, device: torch.device | str) -> list[QuantizedWeights]:
        return list(self.experts)  # type: ignore[arg-type]  (complete: every one built)


def _concat(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """The parts (of one form) stacked by rows."""
    first = parts[0]
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
    return QuantizedTensor(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), offsets, first.bits, first.group_size
    )


def quantize_linears(model: nn.Module, scheme: str) -> dict[str, nn.Module | QuantizedExperts]:
    """Give every Linear of ``model`` a :class:`PendingWeight` under ``scheme`` (its float
    weight dropped), and on the CPU every sparse layer's expert stacks a
    :class:`QuantizedExperts` (on CUDA the fused MoE kernel reads float experts, so they stay
    float there; a sparse layer's router stays float everywhere); the result maps each one's
    weight parameter name to its target, for the loader. ValueError (naming the layer and the
    group) when a group would straddle this tensor-parallel rank's share of a layer's input
    features."""
    from conveyor.worker.models.layers import Linear
    from conveyor.worker.models.moe import SparseMoe

    if scheme not in SCHEMES:
        raise ValueError(f"--quantization {scheme!r}: use one of {', '.join(SCHEMES)}")
    targets: dict[str, nn.Module | QuantizedExperts] = {}
    if scheme == "none":
        return targets
    group = {"int4": INT4_GROUP_SIZE, "checkpoint": GGUF_BLOCK}.get(scheme)

    def check_group(name: str, in_features: int) -> None:
        if group is not None and in_features % group:
            raise ValueError(
                f"--quantization {scheme}: {name} has {in_features} input features on this rank, "
                f"not a multiple of the quantization group of {group}; "
                "use another --tensor-parallel-size or --quantization none"
            )

    cpu = torch.device(model.device).type == "cpu"
    routers = set()  # a sparse layer's router stays float: it is tiny, and its top-k picks are sensitive
    for name, module in model.named_modules():
        if isinstance(module, SparseMoe):
            routers.add(f"{name}.gate")
            for stack, (count, rows, in_features) in module.expert_stacks().items() if cpu else ():
                check_group(f"{name}.{stack}", in_features)
                targets[f"{name}.{stack}"] = module.quantize_experts(
                    stack, QuantizedExperts(scheme, count, rows, in_features, model.device)
                )
            continue
        if not isinstance(module, Linear) or name in routers:
            continue
        head = name == "lm_head"
        if not head:
            check_group(name, module.in_features)
        module.weight = None
        module.pending = PendingWeight("int8" if head else scheme, module.out_features, module.in_features)
        targets[f"{name}.weight"] = module
    model.quantization = scheme
    return targets


def load_part(
    linear: nn.Module | QuantizedExperts, start: int, part: torch.Tensor | QuantizedTensor, device: torch.device | str
) -> None:
    """Add rows ``start:`` of ``linear``'s weight (or an expert stack's); the last part turns
    them into its method."""
    linear.pending.add(start, part)
    if linear.pending.complete:
        linear.quant = linear.pending.build(device)
        linear.pending = None
