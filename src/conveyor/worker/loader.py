"""Build a :class:`LlamaFamilyModel` from a Hugging Face checkpoint directory.

Strict on purpose: a tensor the model does not expect, a tensor it expects but the files
lack, a shape mismatch or a tensor present twice all raise with the tensor's name. A
silently half-loaded model produces fluent garbage, which is far harder to debug.

A tensor-parallel rank builds its shard of the model and reads only the slices of each
checkpoint tensor its layout names (safetensors slices: the rest of the file is never
copied), after checking the tensor's whole shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.backend import AttentionBackend
from conveyor.worker.attention.triton_backend import backend_for
from conveyor.worker.models.llama import LlamaFamilyModel, WeightSlot
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel

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
) -> tuple[LlamaFamilyModel, ModelConfig]:
    """Read ``config.json`` and all safetensors of ``model_dir`` into a model on ``device``
    (this rank's shard of it under ``tensor_parallel``).

    ``backend`` defaults to the device's (:func:`backend_for`: Triton on CUDA, the torch
    reference on CPU). The model comes back in eval mode without gradients and with no KV
    cache bound.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, device, config)
    model = LlamaFamilyModel(config, backend or backend_for(device), torch_dtype, device, tensor_parallel)
    load_weights(model, safetensors_files(model_dir))
    model.pack_cpu_weights()  # (a no-op off the CPU)
    return model.eval(), config


@torch.no_grad()
def load_weights(model: LlamaFamilyModel, files: list[Path]) -> None:
    """Copy every tensor of ``files`` (the part its slot names) into the slot
    :meth:`LlamaFamilyModel.checkpoint_layout` gives it, converting dtype and device on the
    way; raise unless every slot is filled once."""
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                if name not in layout:
                    raise ValueError(f"unexpected weight {name!r} in {file.name} for {model.config.architecture}")
                slot = layout[name]
                if slot is None:
                    continue
                if name in loaded:
                    raise ValueError(f"weight {name!r} appears twice in the checkpoint (again in {file.name})")
                stored = reader.get_slice(name)
                shape = tuple(stored.get_shape())
                if shape != slot.shape:
                    raise ValueError(f"weight {name!r} has shape {shape}, expected {slot.shape}")
                target = params[slot.name][slot.start : slot.end]
                part = stored[_index(slot)]
                if part.shape != target.shape:
                    raise ValueError(
                        f"slot of weight {name!r} reads shape {tuple(part.shape)} into {tuple(target.shape)}"
                    )
                target.copy_(part)
                loaded.add(name)
    missing = sorted(name for name, slot in layout.items() if slot is not None and name not in loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {', '.join(missing)}")


def _index(slot: WeightSlot) -> tuple[slice, ...]:
    """The safetensors slice index of the part of a checkpoint tensor ``slot`` reads."""
    rows = slice(*slot.rows) if slot.rows is not None else slice(None)
    return (rows,) if slot.cols is None else (rows, slice(*slot.cols))
