"""The architectures Conveyor serves: Hugging Face ``architectures`` name -> the model class
that implements it, named as ``module:Class`` (:mod:`conveyor.worker.models.registry` imports it).

Torch-free on purpose, like :mod:`.model_config`: bin/serve and the engine refuse a checkpoint
of an architecture nobody implements before any process starts or any weight loads, with the
one error of :func:`check_architecture`, and the worker builds the class this table names.
Adding an architecture is one model file in ``conveyor/worker/models/`` (implementing
:class:`conveyor.worker.models.interface.CausalLM`), its line here and its test.
"""

from __future__ import annotations

_LLAMA = "conveyor.worker.models.llama:LlamaFamilyModel"
_MOE = "conveyor.worker.models.moe_decoder:MoeDecoderModel"

#: HF architecture name -> ``"module:Class"`` of the model that serves it.
MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Gemma3ForCausalLM": "conveyor.worker.models.gemma3:Gemma3Model",
    "Qwen3MoeForCausalLM": _MOE,
    "MixtralForCausalLM": _MOE,
}

SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)


def check_architecture(architecture: str) -> str:
    """``architecture`` if a model implements it, else ValueError naming it and listing the supported ones."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"unsupported architecture {architecture!r} (config.json 'architectures'); "
            f"supported: {', '.join(MODEL_CLASSES)}"
        )
    return architecture
