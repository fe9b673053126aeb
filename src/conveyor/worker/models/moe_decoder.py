"""Mixture-of-experts decoders of the Llama family: Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3's
attention with per-head q/k norms, top-k weights renormalized as ``norm_topk_prob`` says,
dense MLPs in ``mlp_only_layers``) and Mixtral (``MixtralForCausalLM``: Mistral's attention,
top-k weights always renormalized).

Everything but the sparse layers' MLP is :class:`~conveyor.worker.models.llama.LlamaFamilyModel`'s:
the layer's ``mlp`` is a :class:`~conveyor.worker.models.moe.SparseMoe` where
:attr:`~conveyor.checkpoints.moe_config.MoeConfig.sparse_layers` says, the routing rules come
from :class:`~conveyor.checkpoints.moe_config.MoeConfig`, and the two architectures differ only
in their checkpoint names (Qwen's ``mlp.experts.N.gate_proj``, Mixtral's
``block_sparse_moe.experts.N.w1``). LoRA attaches to the attention projections only: an
adapter for the experts is refused with the other unknown targets
(:mod:`conveyor.worker.lora_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from conveyor.checkpoints.moe_config import EXPERT_NAMES
from conveyor.worker.models.interface import DECODER_LORA_TARGETS, LoraTarget, WeightSlot
from conveyor.worker.models.llama import LlamaFamilyModel
from conveyor.worker.models.moe import SparseMoe
from conveyor.worker.parallel import TensorParallel

__all__ = ["MoeDecoderModel"]


class MoeDecoderModel(LlamaFamilyModel):
    """The whole causal LM (:class:`~conveyor.worker.models.interface.CausalLM`) of a
    Qwen3-MoE or Mixtral checkpoint."""

    #: Attention only: LoRA on experts is not supported (module docstring).
    lora_targets: ClassVar[Mapping[str, LoraTarget]] = {
        name: target for name, target in DECODER_LORA_TARGETS.items() if target.module == "self_attn"
    }

    def layer_mlp(
        self, layer: int, dtype: torch.dtype, device: torch.device | str, tensor_parallel: TensorParallel
    ) -> nn.Module | None:
        moe = self.config.moe
        assert moe is not None, "a mixture-of-experts architecture parses its experts (ModelConfig.moe)"
        return SparseMoe(self.config, dtype, device, tensor_parallel) if moe.sparse_layers[layer] else None

    def checkpoint_layout(self) -> dict[str, WeightSlot | None]:
        """The dense layout (:meth:`~conveyor.worker.models.decoder.DecoderLM.base_layout`) with
        each sparse layer's dense MLP slots replaced by its router and experts
        (:meth:`SparseMoe.layout`)."""
        layout = super().checkpoint_layout()
        config = self.config
        names = EXPERT_NAMES[config.architecture]
        for i, layer in enumerate(self.layers):
            if not isinstance(layer.mlp, SparseMoe):
                continue
            theirs = f"model.layers.{i}"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del layout[f"{theirs}.mlp.{proj}.weight"]
            layout.update(layer.mlp.layout(theirs, f"layers.{i}.mlp", names, config.moe.intermediate_size))
        return layout
