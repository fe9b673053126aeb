"""The architecture registry and the model interface: every registered architecture builds a
model that implements :class:`CausalLM` (on the meta device: no weights, no time), an
unknown one is refused naming itself and the supported ones, and a registered class lacking
the interface is refused naming what it lacks."""

from __future__ import annotations

import pytest
import torch

from conveyor.checkpoints import architectures
from conveyor.checkpoints.architectures import SUPPORTED_ARCHITECTURES
from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.torch_ref import TorchReferenceAttention
from conveyor.worker.models.interface import CausalLM
from conveyor.worker.models.registry import model_class
from conveyor.worker.parallel import TensorParallel

CONFIG = {
    "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 16, "sliding_window": 4,
    "num_experts": 4, "num_local_experts": 4, "moe_intermediate_size": 8, "num_experts_per_tok": 2,
    "use_sliding_window": True,
}  # fmt: skip


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
@pytest.mark.parametrize("rank", [0, 1])
def test_every_registered_architecture_implements_the_interface(architecture, rank):
    config = ModelConfig.from_dicts({**CONFIG, "architectures": [architecture]})
    tp = TensorParallel(rank, 2)
    model = model_class(architecture)(config, TorchReferenceAttention(), torch.float32, "meta", tp)
    assert isinstance(model, CausalLM) and isinstance(model, torch.nn.Module)
    assert model.dtype == torch.float32 and model.device.type == "meta"
    assert [layer.sliding_window for layer in model.attention_layers()] == [
        config.layer_sliding_window(i) for i in range(config.num_layers)
    ]
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters())
    filled = {slot.name for slot in layout.values() if slot is not None}
    assert filled == set(params), "every parameter filled from the checkpoint, nothing else"
    for target, where in model.lora_targets.items():  # LoRA finds each target's Linear through the layout
        slot = layout[f"model.layers.1.{where.module}.{target}.weight"]
        assert slot is not None and hasattr(model.get_submodule(slot.name.removesuffix(".weight")), "lora")


def test_an_unknown_architecture_is_named_with_the_supported_ones():
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*supported: LlamaForCausalLM.*Gemma3ForCausalLM"
    ):
        model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dicts({**CONFIG, "architectures": ["GPT2LMHeadModel"]})


def test_a_registered_class_without_the_interface_is_refused(monkeypatch):
    monkeypatch.setitem(architectures.MODEL_CLASSES, "LinearForCausalLM", "conveyor.worker.models.layers:Linear")
    with pytest.raises(
        TypeError, match=r"layers\.Linear \(registered for LinearForCausalLM\) lacks lora_targets, compute_logits"
    ):
        model_class("LinearForCausalLM")
