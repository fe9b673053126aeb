"""Gemma 3, text only (``Gemma3ForCausalLM``), on the decoder interface of :mod:`.decoder`.

What sets it apart from the Llama family, each as transformers' implementation does it:

* **Interleaved local and global layers.** ``layer_types`` marks sliding-window layers (a
  query sees the last ``sliding_window`` positions, itself included) and full ones; the two
  rotate with their own rope bases (``rope_local_base_freq`` / the ``sliding_attention``
  rope parameters vs ``rope_theta``; rope scaling, e.g. linear, on the global layers only
  where the config says so): :meth:`ModelConfig.layer_rope`, one table per base.
* **(1 + w) RMSNorm** everywhere (layer norms, q/k norms, final norm): the checkpoint stores
  ``w``, the norm multiplies by ``1 + w``. The loader reads ``w`` and :meth:`Gemma3Model.
  weights_loaded` adds the 1 once, so every norm (the fused CUDA kernels included) is the
  plain ``x / rms(x) * weight``. In float32 that is exact; in half precision ``1 + w`` is
  rounded to the dtype once, where transformers keeps it in float32.
* **Four norms per layer:** pre- and post-attention (``input_layernorm``,
  ``post_attention_layernorm``), pre- and post-feed-forward; a post-norm is applied to the
  sublayer's output before it joins the residual stream.
* **GeGLU** MLP (``gelu_pytorch_tanh``), q/k RMSNorm per head, scores scaled by
  ``query_pre_attn_scalar ** -0.5`` (not ``head_dim``), the embedding multiplied by
  ``sqrt(hidden_size)`` (rounded to the dtype, as transformers does), tied embeddings
  (``tie_word_embeddings`` false is honoured too).
* **Final-logit soft-capping** where the config sets it: ``final_logit_softcapping`` C maps
  logits to ``C * tanh(logits / C)``. ``attn_logit_softcapping`` (Gemma 2's score capping)
  is a field transformers' Gemma 3 reads but never applies, so a config setting it is refused
  by :class:`~conveyor.checkpoints.model_config.ModelConfig` rather than served one way or
  the other. Released Gemma 3 checkpoints set neither.

Sliding windows reach every attention backend through the layer's
:class:`~conveyor.worker.attention.backend.AttentionLayer` (torch reference and batched on the
CPU, the Triton extend and paged-decode kernels on CUDA), as Mistral's do.
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

__all__ = ["Gemma3DecoderLayer", "Gemma3Model"]

_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: ``norm(x) -> attention -> post-norm`` and ``norm -> MLP ->
    post-norm``, each added to the residual stream. The stream travels beside the sublayer
    output, as in the Llama layer, so each residual add happens inside the next norm."""

    def __init__(
        self,
        config: ModelConfig,
        self_attn: DecoderAttention,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel,
    ) -> None:
        super().__init__()
        for name in _LAYER_NORMS:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device))
        self.self_attn = self_attn
        intermediate = tensor_parallel.split(config.intermediate_size, "intermediate_size")  # this rank's
        self.mlp = GatedMLP(config.hidden_size, intermediate, dtype, device, tensor_parallel, config.hidden_act)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: the previous sublayer's output (the embedding at layer 0, where
        ``residual`` is None); returns this layer's MLP output and the stream before it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(DecoderLM):
    """The whole Gemma 3 text model (:class:`~conveyor.worker.models.interface.CausalLM`)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> None:
        super().__init__()
        self.config = config
        self.tensor_parallel = tensor_parallel
        extra = config.hf_config
        self.final_softcap: float | None = extra.get("final_logit_softcapping")
        scale = float(extra.get("query_pre_attn_scalar", 256)) ** -0.5  # transformers' default
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        rotaries = layer_rotaries(config, device)
        self.layers = nn.ModuleList()
        for layer in range(config.num_layers):
            attention = DecoderAttention(config, layer, rotaries[layer], scale, backend, dtype, device, tensor_parallel)
            self.layers.append(Gemma3DecoderLayer(config, attention, dtype, device, tensor_parallel))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        separate_head = not config.tie_word_embeddings and tensor_parallel.rank == 0
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device) if separate_head else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the flattened batch ``input_ids`` ``[T]``."""
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits, soft-capped where the config says."""
        logits = super().compute_logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def checkpoint_layout(self) -> dict[str, WeightSlot | None]:
        return self.base_layout(_LAYER_NORMS)

    @torch.no_grad()
    def weights_loaded(self) -> None:
        """Turn every norm's stored ``w`` into the ``1 + w`` it multiplies by (module docstring),
        then what every decoder derives (:meth:`DecoderLM.weights_loaded`)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(1.0)
        super().weights_loaded()
