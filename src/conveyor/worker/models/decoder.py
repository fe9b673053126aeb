"""What every decoder here shares: the attention module with fused q/k/v, the
:class:`~conveyor.worker.models.interface.CausalLM` plumbing (cache binding, logits, dtype) and
the checkpoint layout of the projections, so an architecture's module writes only its layer.

q/k/v and gate/up projections are fused into one matmul each; :meth:`DecoderLM.base_layout`
says which rows of a fused parameter each checkpoint tensor fills. Tensor parallelism
(:mod:`conveyor.worker.parallel`) splits the same modules: a rank's qkv_proj holds its query
heads and kv heads, its gate_up_proj its share of the intermediate features, and o_proj /
down_proj the matching input columns (row-parallel, one all-reduce each); the layout names
the slice of each checkpoint tensor a rank reads.

Parameter names mirror the checkpoint's, minus the ``model.`` prefix and with q/k/v and
gate/up fused; a subclass keeps ``embed_tokens``, ``layers`` (each with ``self_attn`` a
:class:`DecoderAttention` and ``mlp`` a :class:`~conveyor.worker.models.layers.GatedMLP`),
``norm`` and ``lm_head`` (None when tied or off rank 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata
from conveyor.worker.attention.kv_quant import UNIT_SCALES, KVScales
from conveyor.worker.models.interface import DECODER_LORA_TARGETS, LoraTarget, WeightSlot
from conveyor.worker.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    linear,
    pack_cpu_weight,
    pack_cpu_weights,
)
from conveyor.worker.parallel import TensorParallel, shard_heads


def layer_rotaries(config: ModelConfig, device: torch.device | str) -> list[RotaryEmbedding]:
    """Each layer's rotary table (:meth:`ModelConfig.layer_rope`: Gemma 3's sliding layers
    rotate with their own base), one table per distinct ``(theta, scaling)`` shared by the
    layers that use it."""
    tables: dict[str, RotaryEmbedding] = {}
    rotaries = []
    for layer in range(config.num_layers):
        theta, scaling = config.layer_rope(layer)
        key = repr((theta, sorted((scaling or {}).items())))
        if key not in tables:
            tables[key] = RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, scaling, device)
        rotaries.append(tables[key])
    return rotaries


class DecoderAttention(nn.Module):
    """Self-attention of one layer. Writes this step's keys/values into its cache layer, then
    attends over the cache; the cache must be bound (:meth:`DecoderLM.bind_kv_cache`).
    ``attention`` holds what the backend reads of this layer (its heads on this rank,
    ``scale``, the config's window for ``layer``, ``rotary``, q/k norms when the config has
    them and, once bound, its cache)."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        scale: float,
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
            scale=scale,
            sliding_window=config.layer_sliding_window(layer),
            rotary=rotary,
            qk_norm=(self.q_norm, self.k_norm) if config.qk_norm else None,
        )
        self.backend = backend

    def bind_kv_cache(self, cache: torch.Tensor, scales: KVScales = UNIT_SCALES) -> None:
        """Read and write ``cache`` from now on (its layout: :mod:`conveyor.worker.attention.backend`),
        by ``scales`` when it is 8-bit."""
        self.attention = replace(self.attention, kv_cache=cache, kv_scales=scales)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        query = self.backend.rotate_and_store(self.attention, positions, self.qkv_proj(hidden), metadata)
        out = self.backend.forward(self.attention, query, metadata)
        return self.o_proj(out.flatten(1))


class DecoderLM(nn.Module):
    """The :class:`~conveyor.worker.models.interface.CausalLM` methods every decoder here
    shares; a subclass builds the modules (module docstring) and its ``forward``.

    With ``tensor_parallel`` of size N, the model is rank ``tensor_parallel.rank``'s shard;
    the embedding and norms are whole on every rank, and the LM head exists on rank 0 only
    (the one rank that computes logits)."""

    lora_targets: ClassVar[Mapping[str, LoraTarget]] = DECODER_LORA_TARGETS

    config: ModelConfig
    tensor_parallel: TensorParallel
    embed_tokens: nn.Module
    layers: nn.ModuleList
    lm_head: Linear | None
    #: The tied LM head (the embedding) packed for the CPU matmul, or None (:meth:`weights_loaded`).
    tied_head_packed: torch.Tensor | None = None
    #: The weight quantization scheme (:mod:`conveyor.worker.quantization.loading`; set by
    #: the loader). A tied LM head stays the float embedding under every scheme (greedy
    #: agreement: docs/quantization.md).
    quantization: str = "none"
    #: The tied LM head's :attr:`Linear.row_tile <conveyor.worker.models.layers.Linear.row_tile>`.
    row_tile = 1

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attention for layer in self.layers]

    def bind_kv_cache(self, kv_caches: list[torch.Tensor], scales: list[KVScales] | None = None) -> None:
        """Give layer ``i`` the cache tensor ``kv_caches[i]`` (and, 8-bit, its ``scales[i]``);
        later forwards read and write it."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV cache layers for {len(self.layers)} model layers")
        scales = scales if scales is not None else [UNIT_SCALES] * len(kv_caches)
        if len(scales) != len(kv_caches):
            raise ValueError(f"{len(scales)} KV scales for {len(kv_caches)} KV cache layers")
        for layer, cache, layer_scales in zip(self.layers, kv_caches, scales):
            layer.self_attn.bind_kv_cache(cache, layer_scales)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab]`` logits of the rows of ``hidden`` the caller selected (on
        tensor-parallel rank 0 only: the others hold no LM head)."""
        if self.tensor_parallel.rank != 0:
            rank = self.tensor_parallel.rank
            raise RuntimeError(f"tensor-parallel rank {rank} holds no LM head: rank 0 computes logits")
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return linear(hidden, self.embed_tokens.weight, None, self.tied_head_packed, self.row_tile).float()

    def weights_loaded(self) -> None:
        """Pack every projection's weight for the CPU matmul (:func:`~conveyor.worker.models.
        layers.pack_cpu_weights`; a no-op off the CPU and in other dtypes), the tied LM head's
        too (a packed copy of the embedding). A subclass that derives parameters from what the
        checkpoint stores does so first, then calls this."""
        pack_cpu_weights(self)
        if self.lm_head is None and self.tensor_parallel.rank == 0:
            self.tied_head_packed = pack_cpu_weight(self.embed_tokens.weight)

    def base_layout(self, layer_norms: tuple[str, ...]) -> dict[str, WeightSlot | None]:
        """The layout of the modules every decoder here has (embedding, final norm, LM head,
        per layer the q/k/v/o and gate/up/down projections, q/k norms when the config has
        them) and of each layer's norms ``layer_norms`` (``input_layernorm`` ...).

        ``None`` marks tensors that may be present and are ignored: rotary ``inv_freq``
        buffers some old checkpoints saved, and ``lm_head.weight`` when embeddings are tied
        or on a tensor-parallel rank other than 0. A tensor-parallel rank's slots name the
        rows (q/k/v by head, gate/up by feature, biases with their rows) or columns (o/down)
        of its shard; norms, embedding and LM head are read whole.
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
        else:  # (from the layer: a quantized head has no float weight)
            shape = (self.lm_head.out_features, self.lm_head.in_features)
            layout["lm_head.weight"] = WeightSlot("lm_head.weight", 0, shape[0], shape)
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
            for norm in layer_norms:
                whole(f"{theirs}.{norm}.weight", f"{ours}.{norm}.weight")
        return layout
