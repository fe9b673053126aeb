"""One decoder for the Llama family: Llama (incl. Llama-3 rope scaling), Mistral (sliding
window), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), tied or untied embeddings.

The variants differ only in what :class:`~conveyor.checkpoints.model_config.ModelConfig` says,
so there is one code path. It runs flattened ragged batches: ``T`` new tokens of many
sequences laid end to end, positions given per token, attention through an
:class:`~conveyor.worker.attention.backend.AttentionBackend` over the paged KV cache.

q/k/v and gate/up projections are fused into one matmul each; :meth:`LlamaFamilyModel.
checkpoint_layout` says which rows of a fused parameter each checkpoint tensor fills.

Tensor parallelism (:mod:`conveyor.worker.parallel`) splits the same modules: a rank's
qkv_proj holds its query heads and kv heads, its gate_up_proj its share of the intermediate
features, and o_proj/down_proj the matching input columns (row-parallel, one all-reduce
each); the checkpoint layout names the slice of each checkpoint tensor a rank reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata
from conveyor.worker.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluGatedMLP,
    linear,
    pack_cpu_weight,
    pack_cpu_weights,
)
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel, shard_heads


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: its part ``rows`` x ``cols`` fills rows ``start:end``
    (dim 0) of our parameter ``name``.

    ``shape`` is the checkpoint tensor's whole shape, checked before anything is read;
    ``rows`` and ``cols`` are ``(begin, end)`` ranges of its dims 0 and 1 (``None``: all of
    it), so a tensor-parallel rank reads only its shard.
    """

    name: str
    start: int
    end: int
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None


class LlamaAttention(nn.Module):
    """Self-attention of one layer. Writes this step's keys/values into its cache layer, then
    attends over the cache; the cache must be bound (:meth:`LlamaFamilyModel.bind_kv_cache`).
    ``attention`` holds what the backend reads of this layer (its heads on this rank, scale,
    window, rotary table, q/k norms and, once bound, its cache)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel,
    ) -> None:
        super().__init__()
        heads = shard_heads(config.num_heads, config.num_kv_heads, tensor_parallel)  # this rank's
        q_size, kv_size = heads.num_heads * config.head_dim, heads.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias, dtype, device)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, config.o_proj_bias, dtype, device, tensor_parallel)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.attention = AttentionLayer(
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5,
            sliding_window=config.layer_sliding_window(layer),
            rotary=rotary,
            qk_norm=(self.q_norm, self.k_norm) if config.qk_norm else None,
        )
        self.backend = backend

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """Read and write ``cache`` from now on (its layout: :mod:`conveyor.worker.attention.backend`)."""
        self.attention = replace(self.attention, kv_cache=cache)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        query = self.backend.rotate_and_store(self.attention, positions, self.qkv_proj(hidden), metadata)
        out = self.backend.forward(self.attention, query, metadata)
        return self.o_proj(out.flatten(1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block around ``self_attn`` (built by the model, which alone knows the layer's
    index, rotary table and attention backend); the residual stream travels beside the
    normalized hidden state so each residual add happens inside the following norm."""

    def __init__(
        self,
        config: ModelConfig,
        self_attn: LlamaAttention,
        dtype: torch.dtype,
        device: torch.device | str,
        tensor_parallel: TensorParallel,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        intermediate = tensor_parallel.split(config.intermediate_size, "intermediate_size")  # this rank's
        self.mlp = SiluGatedMLP(config.hidden_size, intermediate, dtype, device, tensor_parallel)

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
    prefix and with q/k/v and gate/up fused.

    With ``tensor_parallel`` of size N, this is rank ``tensor_parallel.rank``'s shard; the
    embedding and final norm are whole on every rank, and the LM head exists on rank 0 only
    (the one rank that computes logits)."""

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
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, device
        )
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList()
        for layer in range(config.num_layers):
            attention = LlamaAttention(config, layer, rotary, backend, dtype, device, tensor_parallel)
            self.layers.append(LlamaDecoderLayer(config, attention, dtype, device, tensor_parallel))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        separate_head = not config.tie_word_embeddings and tensor_parallel.rank == 0
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device) if separate_head else None
        self.tied_head_packed: torch.Tensor | None = None

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Give layer ``i`` the cache tensor ``kv_caches[i]``; later forwards read and write it."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV cache layers for {len(self.layers)} model layers")
        for layer, cache in zip(self.layers, kv_caches):
            layer.self_attn.bind_kv_cache(cache)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the flattened batch ``input_ids`` ``[T]``."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab]`` logits of the rows of ``hidden`` the caller selected (on
        tensor-parallel rank 0 only: the others hold no LM head)."""
        if self.tensor_parallel.rank != 0:
            rank = self.tensor_parallel.rank
            raise RuntimeError(f"tensor-parallel rank {rank} holds no LM head: rank 0 computes logits")
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return linear(hidden, self.embed_tokens.weight, None, self.tied_head_packed).float()

    def pack_cpu_weights(self) -> None:
        """Pack every projection's weight for the CPU matmul (:func:`~conveyor.worker.models.
        layers.pack_cpu_weights`), the tied LM head's too (a packed copy of the embedding)."""
        pack_cpu_weights(self)
        if self.lm_head is None and self.tensor_parallel.rank == 0:
            self.tied_head_packed = pack_cpu_weight(self.embed_tokens.weight)

    def checkpoint_layout(self) -> dict[str, WeightSlot | None]:
        """Every tensor name a checkpoint of this config may hold -> where it goes.

        ``None`` marks tensors that may be present and are ignored: rotary ``inv_freq``
        buffers some old checkpoints saved, and ``lm_head.weight`` when embeddings are tied
        or on a tensor-parallel rank other than 0. Every non-``None`` slot must be filled
        exactly once. A tensor-parallel rank's slots name the rows (q/k/v by head, gate/up by
        feature, biases with their rows) or columns (o/down) of its shard; norms, embedding
        and LM head are read whole.
        """
        config, tp = self.config, self.tensor_parallel
        heads = shard_heads(config.num_heads, config.num_kv_heads, tp)
        head_dim, hidden = config.head_dim, config.hidden_size
        q_size, kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim  # this rank's
        q_rows = (heads.q_start * head_dim, heads.q_start * head_dim + q_size)  # of the checkpoint's
        kv_rows = (heads.kv_start * head_dim, heads.kv_start * head_dim + kv_size)
        qkv = {  # projection -> (first row in qkv_proj, its checkpoint rows, its checkpoint row count)
            "q_proj": (0, q_rows, config.num_heads * head_dim),
            "k_proj": (q_size, kv_rows, config.num_kv_heads * head_dim),
            "v_proj": (q_size + kv_size, kv_rows, config.num_kv_heads * head_dim),
        }
        intermediate = config.intermediate_size
        features = tp.shard(intermediate, "intermediate_size")
        share = features[1] - features[0]
        layout: dict[str, WeightSlot | None] = {}

        def whole(checkpoint_name: str, name: str) -> None:
            shape = tuple(self.get_parameter(name).shape)
            layout[checkpoint_name] = WeightSlot(name, 0, shape[0], shape)

        whole("model.embed_tokens.weight", "embed_tokens.weight")
        whole("model.norm.weight", "norm.weight")
        if self.lm_head is None:
            layout["lm_head.weight"] = None
        else:
            whole("lm_head.weight", "lm_head.weight")
        for i in range(config.num_layers):
            ours, theirs = f"layers.{i}", f"model.layers.{i}"
            attn, mlp = f"{ours}.self_attn", f"{ours}.mlp"
            for proj, (start, rows, total) in qkv.items():
                end = start + rows[1] - rows[0]
                layout[f"{theirs}.self_attn.{proj}.weight"] = WeightSlot(
                    f"{attn}.qkv_proj.weight", start, end, (total, hidden), rows=rows
                )
                if config.attention_bias:
                    layout[f"{theirs}.self_attn.{proj}.bias"] = WeightSlot(
                        f"{attn}.qkv_proj.bias", start, end, (total,), rows=rows
                    )
            for proj, start in (("gate_proj", 0), ("up_proj", share)):
                layout[f"{theirs}.mlp.{proj}.weight"] = WeightSlot(
                    f"{mlp}.gate_up_proj.weight", start, start + share, (intermediate, hidden), rows=features
                )
            layout[f"{theirs}.self_attn.o_proj.weight"] = WeightSlot(
                f"{attn}.o_proj.weight", 0, hidden, (hidden, config.num_heads * head_dim), cols=q_rows
            )
            if config.o_proj_bias:
                whole(f"{theirs}.self_attn.o_proj.bias", f"{attn}.o_proj.bias")
            if config.qk_norm:
                whole(f"{theirs}.self_attn.q_norm.weight", f"{attn}.q_norm.weight")
                whole(f"{theirs}.self_attn.k_norm.weight", f"{attn}.k_norm.weight")
            layout[f"{theirs}.self_attn.rotary_emb.inv_freq"] = None
            layout[f"{theirs}.mlp.down_proj.weight"] = WeightSlot(
                f"{mlp}.down_proj.weight", 0, hidden, (hidden, intermediate), cols=features
            )
            whole(f"{theirs}.input_layernorm.weight", f"{ours}.input_layernorm.weight")
            whole(f"{theirs}.post_attention_layernorm.weight", f"{ours}.post_attention_layernorm.weight")
        return layout
