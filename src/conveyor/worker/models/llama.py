"""One decoder for the Llama family: Llama (incl. Llama-3 rope scaling), Mistral (sliding
window), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), tied or untied embeddings.

The variants differ only in what :class:`~conveyor.checkpoints.model_config.ModelConfig` says,
so there is one code path. It runs flattened ragged batches: ``T`` new tokens of many
sequences laid end to end, positions given per token, attention through an
:class:`~conveyor.worker.attention.backend.AttentionBackend` over the paged KV cache.

q/k/v and gate/up projections are fused into one matmul each; :meth:`LlamaFamilyModel.
checkpoint_layout` says which rows of a fused parameter each checkpoint tensor fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.models.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SiluGatedMLP


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: rows ``start:end`` (dim 0) of our parameter ``name``."""

    name: str
    start: int
    end: int


class LlamaAttention(nn.Module):
    """Self-attention of one layer. Writes this step's keys/values into its cache layer, then
    attends over the cache; the cache must be bound (:meth:`LlamaFamilyModel.bind_kv_cache`)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.layer_sliding_window(layer)
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias, dtype, device)
        self.o_proj = Linear(q_size, config.hidden_size, config.o_proj_bias, dtype, device)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rotary(positions, query, key)
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound to the model")
        self.backend.store_kv(key, value, self.kv_cache, metadata)
        out = self.backend.forward(query, self.kv_cache, metadata, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream travels beside the normalized hidden state so
    each residual add happens inside the following norm."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer, rotary, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = SiluGatedMLP(config.hidden_size, config.intermediate_size, dtype, device)

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


class LlamaFamilyModel(nn.Module):
    """The whole causal LM. Parameter names mirror the checkpoint's, minus the ``model.``
    prefix and with q/k/v and gate/up fused."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, device
        )
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layer, rotary, backend, dtype, device) for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        )

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Give layer ``i`` the cache tensor ``kv_caches[i]``; later forwards read and write it."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV cache layers for {len(self.layers)} model layers")
        for layer, cache in zip(self.layers, kv_caches):
            layer.self_attn.kv_cache = cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the flattened batch ``input_ids`` ``[T]``."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab]`` logits of the rows of ``hidden`` the caller selected."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def checkpoint_layout(self) -> dict[str, WeightSlot | None]:
        """Every tensor name a checkpoint of this config may hold -> where it goes.

        ``None`` marks tensors that may be present and are ignored: rotary ``inv_freq``
        buffers some old checkpoints saved, and ``lm_head.weight`` when embeddings are tied.
        Every non-``None`` slot must be filled exactly once.
        """
        config = self.config
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        qkv_rows = {
            "q_proj": (0, q_size),
            "k_proj": (q_size, q_size + kv_size),
            "v_proj": (q_size + kv_size, q_size + 2 * kv_size),
        }
        qkv_suffixes = ["weight", "bias"] if config.attention_bias else ["weight"]
        intermediate = config.intermediate_size
        gate_up_rows = {"gate_proj": (0, intermediate), "up_proj": (intermediate, 2 * intermediate)}
        layout: dict[str, WeightSlot | None] = {}

        def whole(checkpoint_name: str, name: str) -> None:
            layout[checkpoint_name] = WeightSlot(name, 0, self.get_parameter(name).shape[0])

        whole("model.embed_tokens.weight", "embed_tokens.weight")
        whole("model.norm.weight", "norm.weight")
        if self.lm_head is None:
            layout["lm_head.weight"] = None
        else:
            whole("lm_head.weight", "lm_head.weight")
        for i in range(config.num_layers):
            ours, theirs = f"layers.{i}", f"model.layers.{i}"
            for proj, (start, end) in qkv_rows.items():
                for suffix in qkv_suffixes:
                    slot = WeightSlot(f"{ours}.self_attn.qkv_proj.{suffix}", start, end)
                    layout[f"{theirs}.self_attn.{proj}.{suffix}"] = slot
            for proj, (start, end) in gate_up_rows.items():
                layout[f"{theirs}.mlp.{proj}.weight"] = WeightSlot(f"{ours}.mlp.gate_up_proj.weight", start, end)
            whole(f"{theirs}.self_attn.o_proj.weight", f"{ours}.self_attn.o_proj.weight")
            if config.o_proj_bias:
                whole(f"{theirs}.self_attn.o_proj.bias", f"{ours}.self_attn.o_proj.bias")
            if config.qk_norm:
                whole(f"{theirs}.self_attn.q_norm.weight", f"{ours}.self_attn.q_norm.weight")
                whole(f"{theirs}.self_attn.k_norm.weight", f"{ours}.self_attn.k_norm.weight")
            layout[f"{theirs}.self_attn.rotary_emb.inv_freq"] = None
            whole(f"{theirs}.mlp.down_proj.weight", f"{ours}.mlp.down_proj.weight")
            whole(f"{theirs}.input_layernorm.weight", f"{ours}.input_layernorm.weight")
            whole(f"{theirs}.post_attention_layernorm.weight", f"{ours}.post_attention_layernorm.weight")
        return layout
