"""Attention through the Triton kernels of :mod:`conveyor.kernels` (the CUDA path).

A step whose every sequence has exactly one new token is a pure decode and goes through the
split-K paged decode kernel, and so does a static decode-verify step (every sequence the same
few new tokens, ``uniform_query``); any other step (prefill, chunked prefill, mixed prefill
and decode) goes through the extend kernel, which handles one-token sequences too. Both read
keys and values only from the paged cache, so :meth:`store_kv` runs first. An 8-bit cache is
quantized by the stores and dequantized by the attention kernels as they read it, by each
layer's scales (:mod:`~conveyor.worker.attention.kv_quant`).

The kernel modules are imported on first use: importing them decorates Triton functions,
which must happen after ``TRITON_INTERPRET`` is settled (tests run these kernels on CPU
tensors through Triton's interpreter).
"""

from __future__ import annotations

import torch

from conveyor.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata
from conveyor.worker.attention.kv_quant import UNIT_SCALES, KVScales


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
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        scales: KVScales = UNIT_SCALES,
    ) -> None:
        self._kv_store(key, value, kv_cache_layer, metadata.slot_mapping, scales.inv_k, scales.inv_v)

    def rotate_and_store(
        self, layer: AttentionLayer, positions: torch.Tensor, qkv: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """One fused launch (:mod:`conveyor.kernels.rope_kv_store`): q/k norm, rotary, K/V
        store; the query (a view of ``qkv``) is rotated in place."""
        query, key, value = layer.split(qkv)
        norms: dict[str, torch.Tensor | float] = {}
        if layer.qk_norm is not None:
            q_norm, k_norm = layer.qk_norm
            norms = {"q_norm_weight": q_norm.weight, "k_norm_weight": k_norm.weight, "eps": q_norm.eps}
        scales = layer.kv_scales
        return self._rope_kv_store(
            query, key, value, positions, layer.rotary.cos_sin, layer.cache, metadata.slot_mapping, **norms,
            inv_k_scale=scales.inv_k, inv_v_scale=scales.inv_v,
        )  # fmt: skip

    def forward(self, layer: AttentionLayer, query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        kv_cache_layer, scales = layer.cache, layer.kv_scales
        if metadata.max_query_len == 1 or metadata.uniform_query:
            return self._decode(
                query,
                kv_cache_layer,
                metadata.block_tables,
                metadata.seq_lens,
                layer.scale,
                layer.sliding_window,
                max_seq_len=metadata.max_seq_len,
                query_len=metadata.max_query_len,
                k_scale=scales.k,
                v_scale=scales.v,
            )
        return self._extend(
            query,
            kv_cache_layer,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.context_lens,
            metadata.seq_lens,
            layer.scale,
            layer.sliding_window,
            max_query_len=metadata.max_query_len,
            k_scale=scales.k,
            v_scale=scales.v,
        )


class TritonInvariantAttention(TritonPagedAttention):
    """Batch-invariant mode's attention on CUDA: the Triton backend's stores (one program per
    token) and, for every step alike, the kernel of :mod:`conveyor.kernels.invariant_attention`,
    whose reduction over a token's keys is fixed by the token alone."""

    def __init__(self) -> None:
        super().__init__()
        from conveyor.kernels.invariant_attention import invariant_attention

        self._invariant = invariant_attention

    def forward(self, layer: AttentionLayer, query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        scales = layer.kv_scales
        return self._invariant(
            query, layer.cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens, layer.scale,
            layer.sliding_window, max_seq_len=metadata.max_seq_len, k_scale=scales.k, v_scale=scales.v,
        )  # fmt: skip


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
