"""Build a model (the :class:`~conveyor.worker.models.interface.CausalLM` the registry names
for the checkpoint's architecture) from a Hugging Face checkpoint directory.

Strict on purpose: a tensor the model does not expect, a tensor it expects but the files
lack, a shape mismatch or a tensor present twice all raise with the tensor's name. A
silently half-loaded model produces fluent garbage, which is far harder to debug.

A tensor-parallel rank builds its shard of the model and reads only the slices of each
checkpoint tensor its layout names (safetensors slices: the rest of the file is never
copied), after checking the tensor's whole shape. A GGUF checkpoint (a prepared directory
whose ``gguf.json`` names the file) is read through the same loop:
:func:`checkpoint_tensors` is the one place the two formats differ.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from conveyor.checkpoints.gguf.prepare import gguf_file
from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.backend import AttentionBackend
from conveyor.worker.attention.triton_backend import backend_for
from conveyor.worker.models.interface import CausalLM, WeightSlot
from conveyor.worker.models.registry import model_class
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel
from conveyor.worker.quantization.loading import load_part, quantize_linears
from conveyor.worker.quantization.packed_int4 import checkpoint_reader

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str, config: ModelConfig) -> torch.dtype:
    """``auto`` is the checkpoint's dtype on CUDA and float32 on CPU (half-precision matmuls
    on CPU are slow and less accurate); otherwise the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        dtype = config.torch_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those the shard index names, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard files: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype = "auto",
    backend: AttentionBackend | None = None,
    tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
    quantization: str = "none",
) -> tuple[CausalLM, ModelConfig]:
    """Read ``config.json`` and all safetensors of ``model_dir`` into a model on ``device``
    (this rank's shard of it under ``tensor_parallel``).

    ``quantization`` (bin/serve --quantization): ``none`` (float weights), ``int8`` / ``int4``
    / ``fp8`` (a float checkpoint's linear layers quantized as they are read), ``auto`` (a
    block-quantized GGUF file or a GPTQ/AWQ checkpoint kept quantized, anything else float):
    :mod:`conveyor.worker.quantization.loading`.

    ``backend`` defaults to the device's (:func:`backend_for`: Triton on CUDA, the torch
    reference on CPU). The model comes back in eval mode without gradients and with no KV
    cache bound.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, device, config)
    model = model_class(config.architecture)(
        config, backend or backend_for(device), torch_dtype, device, tensor_parallel
    )
    load_weights(model, checkpoint_tensors(model_dir), resolve_quantization(quantization, model_dir))
    return model.eval(), config


def resolve_quantization(quantization: str, model_dir: Path) -> str:
    """The scheme ``quantization`` means for ``model_dir``: ``auto`` is ``checkpoint`` (kept
    as the checkpoint holds it) for a GPTQ/AWQ/compressed-tensors checkpoint, else ``none``
    (a GGUF file dequantized: greedy output equal to transformers' on the file); ``gguf`` is
    ``checkpoint`` for a block-quantized GGUF file (ValueError for any other checkpoint)."""
    source = gguf_file(model_dir)
    if quantization == "auto":
        return "checkpoint" if source is None and checkpoint_reader(model_dir) is not None else "none"
    if quantization != "gguf":
        return quantization
    if source is None:
        raise ValueError(
            f"--quantization gguf keeps a GGUF file's own quantization, and {model_dir} holds no .gguf file"
        )
    from conveyor.worker.gguf_tensors import file_is_quantized

    return "checkpoint" if file_is_quantized(source) else "none"


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, str, Any]]:
    """(file name, tensor name, slice) of every tensor of the checkpoint: safetensors slices
    (a GPTQ/AWQ/compressed-tensors projection's parts as one,
    :func:`~conveyor.worker.quantization.packed_int4.checkpoint_reader`),
    or a GGUF file's tensors read when reached (:mod:`conveyor.worker.gguf_tensors`)."""
    source = gguf_file(model_dir)
    if source is not None:
        from conveyor.worker.gguf_tensors import gguf_tensors

        yield from gguf_tensors(source, json.loads((model_dir / "config.json").read_text()))
        return
    quantized = checkpoint_reader(model_dir)
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            if quantized is not None:  # GPTQ / AWQ / compressed-tensors: a projection's parts as one tensor
                yield from quantized(file.name, reader)
                continue
            for name in reader.keys():
                yield file.name, name, reader.get_slice(name)


@torch.no_grad()
def load_weights(model: CausalLM, tensors: Iterable[tuple[str, str, Any]], quantization: str | None = None) -> None:
    """Copy every tensor of ``tensors`` (:func:`checkpoint_tensors`; the part its slot names)
    into the slot :meth:`~conveyor.worker.models.interface.CausalLM.checkpoint_layout` gives it,
    converting dtype and device on the way (a quantized layer's part quantized, or under
    ``gguf`` kept as the file's blocks: :func:`~conveyor.worker.quantization.loading.load_part`);
    raise unless every slot is filled once; then tell the model
    (:meth:`~conveyor.worker.models.interface.CausalLM.weights_loaded`). ``quantization``
    None: the model's own scheme (a weight update, :mod:`conveyor.worker.weight_updates`,
    is quantized as the start-up load was)."""
    layout = model.checkpoint_layout()
    if quantization is None:
        quantization = getattr(model, "quantization", "none")
    quantized = quantize_linears(model, quantization)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file_name, name, stored in tensors:
        if name not in layout:
            raise ValueError(f"unexpected weight {name!r} in {file_name} for {model.config.architecture}")
        slot = layout[name]
        if slot is None:
            continue
        if name in loaded:
            raise ValueError(f"weight {name!r} appears twice in the checkpoint (again in {file_name})")
        shape = tuple(stored.get_shape())
        if shape != slot.shape:
            raise ValueError(f"weight {name!r} has shape {shape}, expected {slot.shape}")
        if slot.name in quantized:
            linear = quantized[slot.name]
            keep = quantization == "checkpoint" and getattr(stored, "is_quantized", False)
            part = stored.quantized(_index(slot)) if keep else stored[_index(slot)]
            if tuple(part.shape) != (slot.end - slot.start, linear.in_features):
                raise ValueError(
                    f"slot of weight {name!r} reads shape {tuple(part.shape)} "
                    f"into {(slot.end - slot.start, linear.in_features)}"
                )
            load_part(linear, slot.start, part, model.device)
            loaded.add(name)
            continue
        target = params[slot.name][slot.start : slot.end]
        part = stored[_index(slot)]
        if part.shape != target.shape:
            raise ValueError(f"slot of weight {name!r} reads shape {tuple(part.shape)} into {tuple(target.shape)}")
        target.copy_(part)
        loaded.add(name)
    missing = sorted(name for name, slot in layout.items() if slot is not None and name not in loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {', '.join(missing)}")
    model.weights_loaded()
    _release_freed_memory()


def _release_freed_memory() -> None:
    """Hand the heap pages the load freed (each tensor's float or dequantized copy) back to the
    OS: glibc keeps them otherwise, and a quantized model's process would stay as large as the
    load's peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _index(slot: WeightSlot) -> tuple[slice, ...]:
    """The safetensors slice index of the part of a checkpoint tensor ``slot`` reads."""
    rows = slice(*slot.rows) if slot.rows is not None else slice(None)
    return (rows,) if slot.cols is None else (rows, slice(*slot.cols))
