"""Attention through the Triton kernels of :mod:`conveyor.kernels` (the CUDA path).

A step whose every sequence has exactly one new token is a pure decode and goes through the
split-K paged decode kernel, and so does a static decode-verify step (every sequence the same
few new tokens, ``uniform_query``); any other step (prefill, chunked prefill, mixed prefill
and decode) goes through the extend kernel, which handles one-token sequences too. Both read
keys and values only from the paged cache, so :meth:`store_kv` runs first.

The kernel modules are imported on first use: importing them decorates Triton functions,
which must happen after ``TRITON_INTERPRET`` is settled (tests run these kernels on CPU
tensors through Triton's interpreter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from conveyor.worker.models.layers import RMSNorm, RotaryEmbedding


class TritonPagedAttention(AttentionBackend):
    def __init__(self) -> None:
        from conveyor.kernels.extend_attention import extend_attention
        from conveyor.kernels.kv_store import kv_store
        from conveyor.kernels.paged_decode import paged_decode_attention
        from conveyor.kernels.rope_kv_store import rope_kv_store

        self._kv_store = kv_store
        self._rope_kv_store = rope_kv_store
        self._decode = paged_decode_attention
        self._extend = extend_attention

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        self._kv_store(key.to(kv_cache_layer.dtype), value.to(kv_cache_layer.dtype), kv_cache_layer, metadata.slot_mapping)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rotary: RotaryEmbedding,
        qk_norm: tuple[RMSNorm, RMSNorm] | None,
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """One fused launch (:mod:`conveyor.kernels.rope_kv_store`): q/k norm, rotary, K/V
        store; ``query`` (a view of the projection output) is rotated in place."""
        norms = {} if qk_norm is None else {
            "q_norm_weight": qk_norm[0].weight, "k_norm_weight": qk_norm[1].weight, "eps": qk_norm[0].eps
        }
        return self._rope_kv_store(
            query, key, value, positions, rotary.cos_sin, kv_cache_layer, metadata.slot_mapping, **norms
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        query = query.to(kv_cache_layer.dtype)
        if metadata.max_query_len == 1 or metadata.uniform_query:
            return self._decode(
                query,
                kv_cache_layer,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                sliding_window,
                max_seq_len=metadata.max_seq_len,
                query_len=metadata.max_query_len,
            )
        return self._extend(
            query,
            kv_cache_layer,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.context_lens,
            metadata.seq_lens,
            scale,
            sliding_window,
            max_query_len=metadata.max_query_len,
        )


def backend_for(device: torch.device | str, name: str = "auto") -> AttentionBackend:
    """The attention backend to use: ``auto`` is Triton on CUDA and batched torch on CPU.

    ``torch`` is the batched torch backend on any device; ``torch-ref`` the per-sequence
    torch reference (slow, for comparisons).
    """
    from conveyor.worker.attention.torch_batched import TorchBatchedAttention
    from conveyor.worker.attention.torch_ref import TorchReferenceAttention

    kind = torch.device(device).type
    if name == "auto":
        name = "triton" if kind == "cuda" else "torch"
    if name == "triton":
        return TritonPagedAttention()
    if name == "torch":
        return TorchBatchedAttention()
    if name == "torch-ref":
        return TorchReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}: use auto, triton, torch or torch-ref")
