"""compressed-tensors checkpoints (llm-compressor's format, ``quant_method:
compressed-tensors``): W4A16 / W8A16 integer and FP8 weights, read as the loader's slices.

A quantized projection stores, per its ``config_groups`` scheme (one scheme for every Linear
here; ``ignore`` lists layers kept float, e.g. ``lm_head``):

* ``pack-quantized`` (4 bits, symmetric): ``weight_packed`` int32 ``[out, in / 8]``, eight
  signed codes per word along the inputs, the lowest nibble first, each stored plus 8
  (``0..15``); ``weight_scale`` ``[out, in / group]`` (``group``) or ``[out, 1]``
  (``channel``); ``w = scale * (nibble - 8)``.
* ``int-quantized`` / ``naive-quantized`` (8 bits, symmetric): ``weight`` int8 ``[out, in]``
  and ``weight_scale`` as above; ``w = scale * q``.
* ``float-quantized`` (FP8 e4m3): ``weight`` ``[out, in]`` and ``weight_scale`` ``[1]``
  (``tensor``) or ``[out, 1]`` (``channel``); ``w = scale * value``. A static ``input_scale``
  is ignored: activations are quantized per token at run time.

Asymmetric schemes (``weight_zero_point``) are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from conveyor.worker.quantization.tensors import Fp8Tensor, QuantizedTensor

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_PARTS = (".weight_scale", ".weight_zero_point", ".weight_shape", ".input_scale", ".weight_g_idx")


def compressed_scheme(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The one weight scheme of a ``quantization_config``, checked (ValueError naming the field)."""
    fmt = config.get("format")
    if fmt not in FORMATS:
        raise ValueError(
            f"{where}: quantization_config.format {fmt!r} is not supported (supported: {', '.join(FORMATS)})"
        )
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}: quantization_config.config_groups has {len(groups)} schemes; one is supported")
    weights = dict(next(iter(groups.values()))["weights"])
    if not weights.get("symmetric", True):
        raise ValueError(f"{where}: quantization_config weights.symmetric false (zero points) is not supported")
    kind = (weights.get("type"), weights.get("num_bits"))
    if kind not in (("int", 4), ("int", 8), ("float", 8)):
        raise ValueError(
            f"{where}: quantization_config weights {kind[0]} {kind[1]}-bit is not supported (int 4, int 8, float 8)"
        )
    return {**weights, "format": fmt}


def _unpack_rows_of_words(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[out, in / 8]`` -> ``[out, in]`` nibbles, the lowest first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)


class CompressedSlice:
    """One quantized projection behind the loader's slice methods."""

    is_quantized = True

    def __init__(self, reader: Any, prefix: str, stored: str, scheme: dict[str, Any]) -> None:
        self._reader, self._prefix, self._stored, self._scheme = reader, prefix, stored, scheme
        rows, cols = reader.get_slice(prefix + stored).get_shape()
        self._shape = [rows, cols * 8 if stored == ".weight_packed" else cols]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def _decode(self) -> QuantizedTensor | Fp8Tensor:
        rows, cols = self._shape
        scales = self._reader.get_tensor(self._prefix + ".weight_scale").float()
        stored = self._reader.get_tensor(self._prefix + self._stored)
        if self._scheme["type"] == "float":
            return Fp8Tensor(stored.to(torch.float8_e4m3fn), scales.reshape(-1).expand(rows).contiguous())
        scales = scales.reshape(rows, -1)
        group = cols // scales.shape[1]
        if self._stored == ".weight_packed":
            codes = _unpack_rows_of_words(stored).to(torch.uint8)
            return QuantizedTensor(codes, scales, -8 * scales, 4, group)
        return QuantizedTensor(stored.to(torch.int8), scales, None, 8, group)

    def quantized(self, index: tuple[slice, ...]) -> QuantizedTensor | Fp8Tensor:
        return self._decode()[index]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self._decode().dequantize()[index].contiguous()


def compressed_tensors(file_name: str, reader: Any, scheme: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(file, name, slice) of a compressed-tensors safetensors file: a quantized projection's
    parts as one ``<prefix>.weight``, every other tensor as it is."""
    keys = set(reader.keys())
    for name in reader.keys():
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix(".weight_packed")
            yield file_name, prefix + ".weight", CompressedSlice(reader, prefix, ".weight_packed", scheme)
        elif name.endswith(".weight") and name.removesuffix(".weight") + ".weight_scale" in keys:
            yield file_name, name, CompressedSlice(reader, name.removesuffix(".weight"), ".weight", scheme)
        elif not name.endswith(_PARTS):
            yield file_name, name, reader.get_slice(name)
