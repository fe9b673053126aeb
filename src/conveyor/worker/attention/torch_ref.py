"""Paged attention in plain torch, one sequence at a time: the reference.

Clarity over speed: one sequence at a time, keys and values gathered through the block
table into a dense ``[seq_len, kv_heads, head_dim]`` view (an 8-bit cache's dequantized by
definition: stored value times the layer's scale), scores and softmax in float32.
The fast CPU backend (:mod:`.torch_batched`) is tested against this one; ``backend_for(...,
"torch-ref")`` serves with it.
"""

from __future__ import annotations

import torch

from conveyor.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata
from conveyor.worker.attention.kv_quant import UNIT_SCALES, KVScales, from_cache, to_cache


class TorchStoreKV(AttentionBackend):
    """The torch backends' shared half: writing new keys and values into the paged cache."""

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        scales: KVScales = UNIT_SCALES,
    ) -> None:
        """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into their flat slots, skipping
        -1 slots (by :func:`~conveyor.worker.attention.kv_quant.to_cache`'s rule)."""
        num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
        keys = kv_cache_layer[0].view(-1, num_kv_heads, head_dim)
        values = kv_cache_layer[1].view(-1, num_kv_heads, head_dim)
        rows, slots = metadata.stored_slots
        if rows is not None:
            key, value = key.index_select(0, rows), value.index_select(0, rows)
        keys[slots] = to_cache(key, scales.inv_k, keys.dtype)  # (index_put: index_copy_ has no fp8 kernel)
        values[slots] = to_cache(value, scales.inv_v, values.dtype)


class TorchReferenceAttention(TorchStoreKV):
    """:class:`AttentionBackend` with torch ops only; works on any device, loops on the host."""

    def forward(self, layer: AttentionLayer, query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        kv_cache_layer = layer.cache
        _, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_host
        for i, seq_len in enumerate(metadata.seq_lens_host):
            start, end = starts[i], starts[i + 1]
            query_len = end - start
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_tables[i, :num_blocks].long()
            # [2, seq_len, kv_heads, head_dim] -> keys/values [kv_heads, seq_len, head_dim]
            kv = kv_cache_layer[:, blocks].reshape(2, num_blocks * block_size, num_kv_heads, head_dim)[:, :seq_len]
            keys = from_cache(kv[0].transpose(0, 1), layer.kv_scales.k)
            values = from_cache(kv[1].transpose(0, 1), layer.kv_scales.v)
            # [query_len, heads, dim] -> [kv_heads, group, query_len, dim]
            q = query[start:end].view(query_len, num_kv_heads, layer.group, head_dim).permute(1, 2, 0, 3).float()
            scores = torch.einsum("hgqd,hkd->hgqk", q, keys) * layer.scale
            visible = _visible(seq_len - query_len, query_len, seq_len, layer.sliding_window, query.device)
            scores.masked_fill_(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            attended = torch.einsum("hgqk,hkd->hgqd", probs, values)
            out[start:end] = attended.permute(2, 0, 1, 3).reshape(query_len, layer.num_heads, head_dim).to(out.dtype)
        return out


def _visible(
    context_len: int, query_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """``[query_len, seq_len]`` bool: may the new token at row ``r`` (position ``context_len + r``) see key ``k``."""
    query_pos = torch.arange(context_len, context_len + query_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return visible
