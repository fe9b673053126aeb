"""GPTQ and AWQ safetensors checkpoints (``quantization_config`` in config.json): each
projection's ``qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``) read as one
:class:`~.tensors.QuantizedTensor`, under the projection's ``.weight`` name the loader knows.

The two formats, 4 bits, ``G`` groups of ``group_size`` input features, ``W`` ``[out, in]``:

* **GPTQ**: ``qweight`` int32 ``[in / 8, out]``, eight codes per word along the input features,
  the lowest nibble first; ``qzeros`` int32 ``[G, out / 8]``, packed the same way along the
  outputs, stored minus one (``W[n, k] = scales[g, n] * (q[k, n] - (z[g, n] + 1))``);
  ``scales`` ``[G, out]``; ``g_idx`` ``[in]`` the group of each input feature (``k //
  group_size`` unless the checkpoint was made with ``desc_act``, whose shuffled groups are
  dequantized and requantized in order).
* **AWQ** (GEMM layout): ``qweight`` int32 ``[in, out / 8]`` packed along the outputs, word
  nibble ``i`` holding output ``8 j + (0, 2, 4, 6, 1, 3, 5, 7)[i]``; ``qzeros`` ``[G, out / 8]``
  packed alike, not shifted; ``W[n, k] = scales[k // group_size, n] * (q[k, n] - z[g, n])``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from conveyor.worker.quantization.tensors import QuantizedTensor, quantize_int4

METHODS = ("gptq", "awq")
#: AWQ's nibble i holds output column _AWQ_ORDER[i] of its group of 8.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


def checkpoint_reader(model_dir: Path) -> Callable[[str, Any], Iterator[tuple[str, str, Any]]] | None:
    """How to read the safetensors files of a quantized checkpoint (``quantization_config`` in
    its config.json: GPTQ, AWQ or compressed-tensors): ``reader(file_name, safe_open reader)``
    yields the loader's (file, name, slice) triples; None for a float checkpoint; ValueError
    (naming the field) for one Conveyor cannot read."""
    config = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        from conveyor.worker.quantization.compressed_tensors import compressed_scheme, compressed_tensors

        return partial(compressed_tensors, scheme=compressed_scheme(config, f"{model_dir}: config.json"))
    return partial(packed_tensors, config=_packed_config(config, method, model_dir))


def _packed_config(config: dict[str, Any], method: Any, model_dir: Path) -> dict[str, Any]:
    if method not in METHODS:
        supported = ", ".join((*METHODS, "compressed-tensors"))
        raise ValueError(
            f"{model_dir}: config.json quantization_config.quant_method {method!r} is not supported "
            f"(supported: {supported})"
        )
    if config.get("bits") != 4:
        raise ValueError(
            f"{model_dir}: config.json quantization_config.bits {config.get('bits')!r}: {method} is read at 4 bits only"
        )
    if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError(
            f"{model_dir}: config.json quantization_config.version {config['version']!r}: "
            "only AWQ's gemm layout is read"
        )
    return config


def _unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight nibbles (lowest first) along ``dim``, as int32 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 0:
        return nibbles.movedim(-1, 1).reshape(words.shape[0] * 8, *words.shape[1:])
    return nibbles.reshape(*words.shape[:-1], words.shape[-1] * 8)


class PackedInt4Slice:
    """One projection of a GPTQ/AWQ checkpoint behind the loader's slice methods."""

    is_quantized = True

    def __init__(self, reader: Any, prefix: str, config: dict[str, Any]) -> None:
        self._reader, self._prefix, self._config = reader, prefix, config
        rows, cols = reader.get_slice(prefix + ".qweight").get_shape()
        self._shape = [cols, rows * 8] if config["quant_method"] == "gptq" else [cols * 8, rows]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def _get(self, part: str) -> torch.Tensor:
        return self._reader.get_tensor(self._prefix + part)

    def _decode(self) -> QuantizedTensor:
        out_features, in_features = self._shape
        group = self._config.get("group_size", -1)
        group = in_features if group in (-1, None) else int(group)
        scales = self._get(".scales").float()  # [G, out]
        if self._config["quant_method"] == "gptq":
            codes = _unpack(self._get(".qweight"), 0)  # [in, out]
            zeros = _unpack(self._get(".qzeros"), 1) + 1  # [G, out]
            groups = torch.arange(in_features) // group
            if (self._prefix + ".g_idx") in self._reader.keys():
                g_idx = self._get(".g_idx").long()
                if not torch.equal(g_idx, groups):  # desc_act: groups out of order
                    weight = (codes - zeros[g_idx]).float() * scales[g_idx]
                    return quantize_int4(weight.t(), group)
        else:
            order = torch.tensor(_AWQ_ORDER).argsort()
            codes = (
                _unpack(self._get(".qweight"), 1)
                .reshape(in_features, -1, 8)[..., order]
                .reshape(in_features, out_features)
            )
            zeros = _unpack(self._get(".qzeros"), 1)
            zeros = zeros.reshape(zeros.shape[0], -1, 8)[..., order].reshape(zeros.shape[0], out_features)
        scales_t = scales.t().contiguous()
        return QuantizedTensor(
            codes.t().to(torch.uint8).contiguous(), scales_t, -(zeros.t().float() * scales_t), 4, group
        )

    def quantized(self, index: tuple[slice, ...]) -> QuantizedTensor:
        return self._decode()[index]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self._decode().dequantize()[index].contiguous()


def packed_tensors(file_name: str, reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(file, name, slice) of a GPTQ/AWQ safetensors file: a projection's parts as one
    ``<prefix>.weight``, every other tensor as it is."""
    for name in reader.keys():
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            yield file_name, prefix + ".weight", PackedInt4Slice(reader, prefix, config)
        elif not name.endswith(_PARTS):
            yield file_name, name, reader.get_slice(name)
