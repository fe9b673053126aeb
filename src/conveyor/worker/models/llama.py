"""One decoder for the Llama family: Llama (incl. Llama-3 rope scaling), Mistral (sliding
window), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), tied or untied embeddings.

The variants differ only in what :class:`~conveyor.checkpoints.model_config.ModelConfig` says,
so there is one code path. It runs flattened ragged batches (:mod:`.interface`): ``T`` new
tokens of many sequences laid end to end, positions given per token, attention through an
:class:`~conveyor.worker.attention.backend.AttentionBackend` over the paged KV cache. The
attention module, fused projections, tensor-parallel shards and checkpoint layout are
:mod:`.decoder`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.models.decoder import DecoderAttention, DecoderLM, layer_rotaries
from conveyor.worker.models.interface import WeightSlot
from conveyor.worker.models.layers import Embedding, GatedMLP, Linear, RMSNorm
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel

__all__ = ["LlamaDecoderLayer", "LlamaFamilyModel"]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block around ``self_attn`` (built by the model, which alone knows the layer's
    index, rotary table and attention backend) and ``mlp`` (a mixture-of-experts model's
    sparse block; by default the dense gated MLP); the residual stream travels beside the
    normalized hidden state so each residual add happens inside the following norm."""

    def __init__(
        self,
        config: ModelConfig,
        self_attn: DecoderAttention,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        if mlp is None:
            intermediate = tensor_parallel.split(config.intermediate_size, "intermediate_size")  # this rank's
            mlp = GatedMLP(config.hidden_size, intermediate, dtype, device, tensor_parallel, config.hidden_act)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaFamilyModel(DecoderLM):
    """The whole causal LM (:class:`~conveyor.worker.models.interface.CausalLM`), scores
    scaled by ``head_dim ** -0.5``."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{config.architecture} with hidden_act {config.hidden_act!r}: only silu is implemented")
        self.config = config
        self.tensor_parallel = tensor_parallel
        rotaries = layer_rotaries(config, device)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList()
        scale = config.head_dim**-0.5
        for layer in range(config.num_layers):
            attention = DecoderAttention(config, layer, rotaries[layer], scale, backend, dtype, device, tensor_parallel)
            mlp = self.layer_mlp(layer, dtype, device, tensor_parallel)
            self.layers.append(LlamaDecoderLayer(config, attention, dtype, device, tensor_parallel, mlp))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        separate_head = not config.tie_word_embeddings and tensor_parallel.rank == 0
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device) if separate_head else None

    def layer_mlp(
        self, layer: int, dtype: torch.dtype, device: torch.device | str, tensor_parallel: TensorParallel
    ) -> nn.Module | None:
        """Layer ``layer``'s MLP when it is not the dense gated one (None): a mixture-of-experts
        subclass's sparse block (:mod:`.moe_decoder`)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the flattened batch ``input_ids`` ``[T]``."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def checkpoint_layout(self) -> dict[str, WeightSlot | None]:
        """Every tensor name a checkpoint of this config may hold -> where it goes
        (:meth:`~conveyor.worker.models.decoder.DecoderLM.base_layout`)."""
        return self.base_layout(("input_layernorm", "post_attention_layernorm"))
