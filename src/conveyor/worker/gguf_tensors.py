"""The tensors of a GGUF checkpoint as the loader reads safetensors: name, shape, a slice.

:func:`conveyor.worker.loader.checkpoint_tensors` reads a prepared GGUF directory
(:mod:`conveyor.checkpoints.gguf.prepare`) through this. Each tensor is dequantized to float32
by the `gguf` package when reached (:func:`~conveyor.checkpoints.gguf.reader.hf_tensors`),
then the loader copies the part its slot names into the model, converting to the serving
dtype: a tensor-parallel rank slices the dequantized tensor exactly as it slices a
safetensors one, so both formats share every rule of the loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from conveyor.checkpoints.gguf.reader import hf_tensors, open_gguf


class ArraySlice:
    """A dequantized tensor behind the two methods the loader uses of a safetensors slice."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def get_shape(self) -> list[int]:
        return list(self._values.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return torch.from_numpy(np.require(self._values[index], requirements=("C", "W")))


def gguf_tensors(path: Path, config: dict) -> Iterator[tuple[str, str, ArraySlice]]:
    """(file name, HF tensor name, its slice) for every tensor of GGUF file ``path``;
    ``config``: the prepared directory's config.json (heads for the q/k row order)."""
    reader = open_gguf(path)
    for name, values in hf_tensors(reader, config, path):
        yield path.name, name, ArraySlice(values)
