"""A PEFT LoRA adapter's ``adapter_config.json``, checked without torch.

What an adapter directory must say before its weights are worth reading (the files present,
LoRA and nothing unsupported, a rank within ``--max-lora-rank``) is checked here, so that bin/serve
refuses a bad ``--lora-modules`` entry before any process starts
(:mod:`conveyor.assembly.preflight`) with the same words the worker uses when it loads the adapter
(:func:`conveyor.worker.lora.read_adapter`, which starts with this).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoraLoadError(ValueError):
    """An adapter that cannot be served: its message says which and why."""


class LoraFilesMissing(LoraLoadError):
    """The adapter's directory or one of its files does not exist."""


@dataclass(frozen=True)
class AdapterConfig:
    """What the worker needs of ``adapter_config.json``: the rank, the PEFT scaling and the
    target modules (which the model's class checks: :func:`conveyor.worker.lora.read_adapter`)."""

    rank: int
    scaling: float
    targets: tuple[str, ...]


def read_adapter_config(name: str, directory: str | Path, max_rank: int) -> AdapterConfig:
    """Check adapter ``name`` in ``directory`` as far as its config goes; raises
    :class:`LoraLoadError` (:class:`LoraFilesMissing` for a missing file) naming what is wrong.
    Scaling is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise LoraFilesMissing(f"adapter {name!r}: missing file {path}")
    try:
        peft = json.loads(config_path.read_text())
    except ValueError as error:
        raise LoraLoadError(f"adapter {name!r}: {config_path} is not JSON: {error}") from None
    if peft.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"adapter {name!r}: peft_type {peft.get('peft_type')!r} is not LORA")
    if peft.get("use_dora") or peft.get("bias", "none") != "none" or peft.get("modules_to_save"):
        raise LoraLoadError(f"adapter {name!r}: DoRA, trained biases and modules_to_save are not supported")
    rank = int(peft.get("r", 8))
    if not 1 <= rank <= max_rank:
        raise LoraLoadError(
            f"adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank} (raise --max-lora-rank to at least "
            f"{rank})"
        )
    if peft.get("rank_pattern") or peft.get("alpha_pattern"):
        raise LoraLoadError(f"adapter {name!r}: per-module rank_pattern/alpha_pattern are not supported")
    targets = peft.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    alpha = float(peft.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scaling, tuple(targets))
