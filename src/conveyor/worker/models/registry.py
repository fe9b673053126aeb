"""The model class of an architecture: :data:`conveyor.checkpoints.architectures.MODEL_CLASSES`
(HF ``architectures`` name -> ``module:Class``, torch-free so start-up checks need no torch)
resolved to the class, importing only the module of the architecture served."""

from __future__ import annotations

import importlib

from conveyor.checkpoints.architectures import MODEL_CLASSES, check_architecture
from conveyor.worker.models.interface import CausalLM


def model_class(architecture: str) -> type[CausalLM]:
    """The class implementing ``architecture``; ValueError (naming it and the supported ones)
    for one no model implements, TypeError for a registered class lacking the interface."""
    module_name, _, class_name = MODEL_CLASSES[check_architecture(architecture)].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    missing = [name for name in _REQUIRED if not hasattr(cls, name)]
    if missing:
        raise TypeError(f"{module_name}.{class_name} (registered for {architecture}) lacks {', '.join(missing)}")
    return cls


# What a class must define to implement CausalLM (attributes set in __init__ are not checked).
_REQUIRED = (
    "lora_targets",
    "forward",
    "compute_logits",
    "bind_kv_cache",
    "attention_layers",
    "checkpoint_layout",
    "weights_loaded",
    "dtype",
    "device",
)
