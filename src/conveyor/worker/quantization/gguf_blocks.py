"""GGUF's quantized blocks as :class:`~.tensors.QuantizedTensor`, read from the file's bytes.

Q8_0, Q4_0 and Q4_1 are decoded exactly (each block of 32 is one group): Q8_0 is an f16
scale ``d`` and 32 int8 codes (``d * q``); Q4_0 an f16 ``d`` and 16 bytes of nibbles, element
``j`` in the low nibble of byte ``j`` and element ``j + 16`` in its high nibble (``d * (q -
8)``); Q4_1 an f16 ``d``, an f16 minimum ``m`` and the same nibbles (``d * q + m``). The other
types (k-quants, i-quants) are dequantized by the `gguf` package one tensor at a time and
requantized: 4 bits or fewer to int4 in groups of 32, more to int8 per channel.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from conveyor.worker.quantization.tensors import QuantizedTensor, quantize_int4, quantize_int8

BLOCK = 32
#: Types requantized to int4 (4 bits or fewer per weight); any other quantized type to int8.
_FOUR_BITS = {
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "IQ4_NL",
    "IQ4_XS",
    "IQ3_S",
    "IQ3_XXS",
    "IQ2_S",
    "IQ2_XS",
    "IQ2_XXS",
    "IQ1_S",
    "IQ1_M",
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def is_quantized(qtype: Q) -> bool:
    return qtype not in FLOAT_TYPES


def decode_blocks(data: np.ndarray, qtype: Q, rows: int, cols: int) -> QuantizedTensor:
    """The ``[rows, cols]`` tensor stored as ``data`` (the file's bytes, one row of blocks per
    weight row) in quantized form (module docstring)."""
    if qtype == Q.Q8_0:
        blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, cols // BLOCK, 34)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return QuantizedTensor(torch.from_numpy(codes), torch.from_numpy(scales), None, 8, BLOCK)
    if qtype in (Q.Q4_0, Q.Q4_1):
        head = 2 if qtype == Q.Q4_0 else 4
        blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, cols // BLOCK, head + 16)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., head:]
        codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, cols)
        if qtype == Q.Q4_0:
            offsets = -8 * scales
        else:
            offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return QuantizedTensor(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(offsets), 4, BLOCK)
    values = torch.from_numpy(dequantize(data, qtype).reshape(rows, cols))
    if qtype.name in _FOUR_BITS and cols % BLOCK == 0:
        return quantize_int4(values, BLOCK)
    return quantize_int8(values)


def unpermute_quantized(weight: QuantizedTensor, heads: int, unpermute) -> QuantizedTensor:
    """``weight`` with ``unpermute`` (the reader's rotary row reorder) applied to every row-wise part."""

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.from_numpy(np.ascontiguousarray(unpermute(t.numpy(), heads)))

    return QuantizedTensor(
        rows(weight.codes), rows(weight.scales), rows(weight.offsets), weight.bits, weight.group_size
    )
