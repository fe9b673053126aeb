"""A quantized Linear's weight in its kernel's layout, and the one call that multiplies by it.

Each class is a quantization method: built once from the weight's parts (:mod:`.tensors`),
it holds what its kernels read (the weight slots: codes, scales, offsets) and
``apply(x, bias)`` picks the kernel of ``x``'s device:

* **int8**, one scale per output channel. CPU: the activations are quantized per token to int8
  on the fly, in two parts (the codes and their rounding error, ~15 bits together, stacked as
  twice the rows of one call), and multiplied by ``torch._int_mm`` (oneDNN's VNNI int8 GEMM),
  scaled back in float32; CUDA: the Triton dequantize-GEMM (:mod:`conveyor.kernels.dequant_gemm`).
* **int4**, group-wise affine (``scale * code + offset``, symmetric being offset ``-8 scale``).
  CPU: ``torch.ops.aten._weight_int4pack_mm_for_cpu``, fast in bfloat16 only (its float32 path
  is a slow reference), so float32 activations go in as two bfloat16 parts (high and the
  rest, stacked as twice the rows of one call) and scales/zeros that bfloat16 does not hold
  exactly (GGUF's f16) as a second call with the rounding residuals; CUDA: the Triton kernel.
* **fp8** (e4m3, one scale per output channel): ``torch._scaled_mm`` with the activations
  quantized per token (CPU and CUDA; sm_89+ on CUDA), bfloat16 output.

docs/quantization.md says why these kernels (measured against the alternatives).
"""

from __future__ import annotations

import torch

from conveyor.worker.quantization.tensors import QuantizedTensor, as_int8_per_channel, quantize_fp8

#: Group sizes torch's CPU int4 matmul takes.
CPU_INT4_GROUPS = (32, 64, 128, 256)


class QuantizedWeights:
    """Base of the methods: ``out_features`` x ``in_features``, ``apply`` the product."""

    method = ""

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features, self.in_features = out_features, in_features

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(out={self.out_features}, in={self.in_features})"

    def nbytes(self) -> int:
        """Bytes of the tensors the kernels read."""
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))


class Int8Weights(QuantizedWeights):
    """int8 codes ``[out, in]`` with float32 ``scales`` ``[out]`` (module docstring)."""

    method = "int8"

    def __init__(self, weight: QuantizedTensor, device: torch.device | str) -> None:
        weight = as_int8_per_channel(weight)
        super().__init__(*weight.shape)
        self.codes = weight.codes.to(device=device, dtype=torch.int8).contiguous()
        self.scales = weight.scales.reshape(-1).to(device=device, dtype=torch.float32).contiguous()
        self.scales_127 = self.scales / 127

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cuda":
            from conveyor.kernels.dequant_gemm import dequant_gemm

            return dequant_gemm(x, self.codes, self.scales[:, None], None, 8, self.in_features, bias)
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        xf = x.float()
        x_max = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)  # per token: x ~ x_max / 127 * code
        steps = xf.mul(127 / x_max)
        high = steps.round()
        low = steps.sub_(high).mul_(254).round_()  # the rest (at most half a step), 1/254 of a step each
        rows = x.shape[0]
        both = torch._int_mm(torch.cat([high, low]).to(torch.int8), self.codes.t()).float()
        y = both[rows:].div_(254).add_(both[:rows]).mul_(x_max * self.scales_127)
        if bias is not None:
            y += bias
        return y.to(x.dtype)


class Int4Weights(QuantizedWeights):
    """Group-wise int4 (module docstring); the layout follows the device: on the CPU torch's
    packed int4 with bfloat16 ``(scale, zero)`` pairs, on CUDA nibble pairs with float32
    ``scales`` / ``offsets`` (:func:`~conveyor.kernels.dequant_gemm.pack_int4`)."""

    method = "int4"

    def __init__(self, weight: QuantizedTensor, device: torch.device | str) -> None:
        if weight.bits != 4:
            raise ValueError(f"Int4Weights takes 4-bit codes, got {weight.bits}")
        super().__init__(*weight.shape)
        self.group_size = weight.group_size
        offsets = weight.offsets if weight.offsets is not None else torch.zeros_like(weight.scales)
        if torch.device(device).type == "cpu":
            if self.group_size not in CPU_INT4_GROUPS:
                raise ValueError(
                    f"int4 group size {self.group_size} on the CPU: it takes {', '.join(map(str, CPU_INT4_GROUPS))}"
                )
            # torch's CPU int4: w = (code - 8) * scale + zero, so zero = offset + 8 * scale; it
            # takes rows in multiples of 16 (padded with zero rows, cut from the output).
            pad = -self.out_features % 16
            codes = torch.nn.functional.pad(weight.codes.to(torch.int32), (0, 0, 0, pad))
            scales, offsets = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (weight.scales, offsets))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            scale_zeros = torch.stack([scales, offsets + 8 * scales], dim=-1).transpose(0, 1).float()
            self.packed = packed
            self.scale_zeros = scale_zeros.to(torch.bfloat16).contiguous()
            residual = (scale_zeros - self.scale_zeros.float()).to(torch.bfloat16).contiguous()
            # (None when bfloat16 holds them: our own quantizer rounds them so, GGUF's f16 do not)
            self.scale_zeros_residual = residual if residual.any() else None
        else:
            from conveyor.kernels.dequant_gemm import pack_int4

            self.packed = pack_int4(weight.codes).to(device)
            self.scales = weight.scales.to(device=device, dtype=torch.float32).contiguous()
            self.offsets = offsets.to(device=device, dtype=torch.float32).contiguous()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cuda":
            from conveyor.kernels.dequant_gemm import dequant_gemm

            return dequant_gemm(x, self.packed, self.scales, self.offsets, 4, self.group_size, bias)
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return _int4_cpu(x, self, bias)


class Fp8Weights(QuantizedWeights):
    """e4m3 ``weight`` ``[out, in]`` with float32 ``scales`` ``[out]`` (module docstring)."""

    method = "fp8"
    MAX = torch.finfo(torch.float8_e4m3fn).max

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, device: torch.device | str) -> None:
        super().__init__(*values.shape)
        self.weight = values.to(device=device, dtype=torch.float8_e4m3fn).contiguous()
        self.scales = scales.reshape(1, -1).to(device=device, dtype=torch.float32).contiguous()

    @classmethod
    def quantize(cls, weight: torch.Tensor, device: torch.device | str) -> Fp8Weights:
        """Per-output-channel e4m3 of a float weight."""
        fp8 = quantize_fp8(weight)
        return cls(fp8.values, fp8.scales, device)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        xf = x.float()
        x_scales = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(self.MAX)
        x_fp8 = (xf / x_scales).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(x_fp8, self.weight.t(), x_scales, self.scales, out_dtype=torch.bfloat16)
        y = y.to(x.dtype)
        return y if bias is None else y.add_(bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.reshape(-1, 1)


def _int4_cpu(x: torch.Tensor, weights: Int4Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T`` through torch's bfloat16 int4 kernel with float32's precision on the input
    side: ``x = high + low`` (both bfloat16, ~16 bits together) run as one call of twice the
    rows, plus ``high`` times the scales' residuals when there are some. The output of each
    call is rounded to bfloat16 (what remains of the kernel's error). docs/quantization.md has
    what each part buys in greedy agreement and costs in time."""
    mm, group = torch.ops.aten._weight_int4pack_mm_for_cpu, weights.group_size
    rows = x.shape[0]
    high = x.bfloat16()
    if x.dtype == torch.bfloat16:
        y = mm(high, weights.packed, group, weights.scale_zeros).float()
    else:
        low = (x.float() - high.float()).bfloat16()
        both = mm(torch.cat([high, low]), weights.packed, group, weights.scale_zeros).float()
        y = both[:rows].add_(both[rows:])
    if weights.scale_zeros_residual is not None:
        y += mm(high, weights.packed, group, weights.scale_zeros_residual)
    y = y[:, : weights.out_features].to(x.dtype)
    return y if bias is None else y.add_(bias)
