"""The tensors of a GGUF checkpoint as the loader reads safetensors: name, shape, a slice.

:func:`conveyor.worker.loader.checkpoint_tensors` reads a prepared GGUF directory
(:mod:`conveyor.checkpoints.gguf.prepare`) through this. Each tensor is read when the loader
indexes it: dequantized to float32 by the `gguf` package (``slice[index]``), or, for a layer
served quantized, its blocks decoded into the quantized form
(:meth:`GGUFSlice.quantized`, :mod:`conveyor.worker.quantization.gguf_blocks`). A
tensor-parallel rank slices either exactly as it slices a safetensors tensor, so both formats
share every rule of the loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from conveyor.checkpoints.gguf.reader import open_gguf, raw_tensors, unpermute
from conveyor.worker.quantization.gguf_blocks import decode_blocks, is_quantized, unpermute_quantized
from conveyor.worker.quantization.tensors import QuantizedTensor


class GGUFSlice:
    """One tensor of the file behind the methods the loader uses of a safetensors slice."""

    def __init__(self, tensor: Any, heads: int | None, offset: float = 0.0) -> None:
        self._tensor, self._heads, self._offset = tensor, heads, offset  # offset: a Gemma norm's stored 1
        self._shape = tuple(reversed([int(d) for d in tensor.shape]))

    def get_shape(self) -> list[int]:
        return list(self._shape)

    @property
    def is_quantized(self) -> bool:
        return is_quantized(self._tensor.tensor_type) and len(self._shape) == 2

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        values = dequantize(self._tensor.data, self._tensor.tensor_type).reshape(self._shape)
        if self._heads is not None:
            values = unpermute(values, self._heads)
        if self._offset:
            values = values - np.float32(self._offset)
        return torch.from_numpy(np.require(values[index], requirements=("C", "W")))

    def quantized(self, index: tuple[slice, ...]) -> QuantizedTensor:
        """The part ``index`` names, kept quantized (a float tensor only for a float type)."""
        assert not self._offset, "an offset tensor (a norm) is never served quantized"
        weight = decode_blocks(self._tensor.data, self._tensor.tensor_type, *self._shape)
        if self._heads is not None:
            weight = unpermute_quantized(weight, self._heads, unpermute)
        return weight[index]


def gguf_tensors(path: Path, config: dict) -> Iterator[tuple[str, str, GGUFSlice]]:
    """(file name, HF tensor name, its slice) for every tensor of GGUF file ``path``;
    ``config``: the prepared directory's config.json (heads for the q/k row order)."""
    reader = _reader(path)
    for name, tensor, heads, offset in raw_tensors(reader, config, path):
        yield path.name, name, GGUFSlice(tensor, heads, offset)


def file_is_quantized(path: Path) -> bool:
    """Whether the file's matrices are block-quantized (what ``--quantization auto`` keeps)."""
    return any(is_quantized(t.tensor_type) and len(t.shape) == 2 for t in _reader(path).tensors)


@lru_cache(maxsize=1)
def _reader(path: Path):
    """The parsed file, kept for the load that asked whether it is quantized (parsing a
    tokenizer's metadata costs seconds)."""
    return open_gguf(path)
