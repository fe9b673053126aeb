"""Paged attention whose result for a token never depends on the rest of the step: batch-invariant mode.

A token's output is a function of its own query, its position and its sequence's cached
keys and values only: not of the other rows of the step, their lengths, how the prompt was
cut into chunks, or whether the token is computed in a prefill, a decode, a recomputation
after preemption or a speculative verification. The batched backend cannot promise that: it
pads a group's key span to its longest member, so a reduction's length (and with it the
order of the additions) moves with the company a token keeps.

Here every reduction has a length fixed by the token alone. Keys are taken in chunks of
:data:`KEY_CHUNK` absolute positions (``0..C-1``, ``C..2C-1``, ...); a token visits, in
increasing order, exactly the chunks that hold a key it may see, and folds each into a
running softmax (maximum, sum, weighted values). Within a chunk the scores and the weighted
values are batched matrix products whose inner length is ``head_dim`` or ``KEY_CHUNK`` and
whose row count is padded to a multiple of 8: the rows a token shares a product with then
change only which rows and batch entries the GEMM runs, which leaves a row's bits alone
(checked at start by :func:`conveyor.worker.batch_invariant.make_batch_invariant`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.worker.attention.backend import AttentionLayer, AttentionMetadata
from conveyor.worker.attention.torch_ref import TorchStoreKV

#: Key positions per chunk of the running softmax: every token's reductions run over chunks
#: of this many slots whatever its context, so the constant is part of the mode's numerics.
KEY_CHUNK = 128
#: The row count of every product is padded to a multiple of this (see the module docstring).
ROW_MULTIPLE = 8


@dataclass
class _Group:
    """The sequences of one key chunk that have the same number of rows in it: ``rows``
    ``[S, R]`` (row indices into the step), ``slots`` ``[S, C]`` (their chunk's cache slots),
    ``stale`` ``[S, C]`` (slots no row of the sequence may see: zeroed, they may hold anything),
    ``hidden`` ``[S, R, C]`` (per row, the slots it may not see)."""

    rows: torch.Tensor
    slots: torch.Tensor
    stale: torch.Tensor
    hidden: torch.Tensor


class TorchInvariantAttention(TorchStoreKV):
    """:class:`AttentionBackend` on torch ops whose per-token result is batch-invariant."""

    def __init__(self) -> None:
        # The step the plans were made for (its metadata object) and the plans by window.
        self._plans_for: AttentionMetadata | None = None
        self._plans: dict[int | None, list[list[_Group]]] = {}

    def forward(self, layer: AttentionLayer, query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        cache = layer.cache
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        num_rows, group = query.shape[0], layer.group
        out = torch.empty_like(query)
        if num_rows == 0:
            return out
        keys = cache[0].reshape(-1, num_kv_heads, head_dim)
        values = cache[1].reshape(-1, num_kv_heads, head_dim)
        device = query.device
        # (An 8-bit cache's scales: the key scale folds into the query's, the value scale into the output.)
        q = query.float().view(num_rows, num_kv_heads, group, head_dim) * (layer.scale * layer.kv_scales.k)
        best = torch.full((num_rows, num_kv_heads, group), float("-inf"), device=device)
        total = torch.zeros((num_rows, num_kv_heads, group), device=device)
        acc = torch.zeros((num_rows, num_kv_heads, group, head_dim), device=device)
        for chunk in self._plan(metadata, layer.sliding_window, block_size):
            for g in chunk:
                seqs, rows_per_seq = g.rows.shape
                k = keys[g.slots].float().masked_fill_(g.stale[:, :, None, None], 0.0)  # [S, C, kv, dim]
                v = values[g.slots].float().masked_fill_(g.stale[:, :, None, None], 0.0)
                k = k.permute(0, 2, 3, 1).reshape(seqs * num_kv_heads, head_dim, KEY_CHUNK)
                v = v.permute(0, 2, 1, 3).reshape(seqs * num_kv_heads, KEY_CHUNK, head_dim)
                # [S, R, kv, group, dim] -> [S * kv, R * group, dim]
                q_g = q[g.rows].permute(0, 2, 1, 3, 4).reshape(seqs * num_kv_heads, rows_per_seq * group, head_dim)
                scores = padded_bmm(q_g, k).view(seqs, num_kv_heads, rows_per_seq, group, KEY_CHUNK)
                scores.masked_fill_(g.hidden[:, None, :, None, :], float("-inf"))
                scores = scores.permute(0, 2, 1, 3, 4)  # [S, R, kv, group, C]
                old_best = best[g.rows]
                new_best = torch.maximum(old_best, scores.amax(dim=-1))
                # A row that has seen no visible key yet keeps -inf; shift by 0 there so that
                # exp(-inf - shift) is 0 rather than NaN.
                shift = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)
                probs = torch.exp(scores - shift[..., None])
                rescale = torch.exp(old_best - shift)
                p_g = probs.permute(0, 2, 1, 3, 4).reshape(seqs * num_kv_heads, rows_per_seq * group, KEY_CHUNK)
                weighted = padded_bmm(p_g, v).view(seqs, num_kv_heads, rows_per_seq, group, head_dim)
                best[g.rows] = new_best
                total[g.rows] = total[g.rows] * rescale + probs.sum(dim=-1)
                acc[g.rows] = acc[g.rows] * rescale[..., None] + weighted.permute(0, 2, 1, 3, 4)
        attended = acc / total[..., None]
        if layer.kv_scales.v != 1.0:
            attended.mul_(layer.kv_scales.v)
        out.copy_(attended.view(num_rows, layer.num_heads, head_dim))
        return out

    def _plan(self, metadata: AttentionMetadata, sliding_window: int | None, block_size: int) -> list[list[_Group]]:
        """The step's plans, made on the first layer that asks and reused by the rest."""
        if self._plans_for is not metadata:
            self._plans_for, self._plans = metadata, {}
        if sliding_window not in self._plans:
            self._plans[sliding_window] = plan_chunks(metadata, sliding_window, block_size)
        return self._plans[sliding_window]


def padded_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``[B, M, K] @ [B, K, N]``) with ``M`` padded by zero rows to a multiple of
    :data:`ROW_MULTIPLE` for the product, then cut back."""
    rows = a.shape[1]
    pad = -rows % ROW_MULTIPLE
    if pad:
        a = torch.cat([a, a.new_zeros(a.shape[0], pad, a.shape[2])], dim=1)
    return torch.bmm(a, b)[:, :rows]


def plan_chunks(metadata: AttentionMetadata, sliding_window: int | None, block_size: int) -> list[list[_Group]]:
    """Per key chunk ``j`` (positions ``j*C .. j*C + C - 1``), the sequences with rows that see a
    key in it (``k <= p``, and ``k > p - W`` with a window ``W``), grouped by that row count."""
    device = metadata.block_tables.device
    starts = metadata.query_start_loc_host
    seq_lens = metadata.seq_lens_host
    table = metadata.block_tables.cpu().numpy().astype(np.int64)
    window = sliding_window if sliding_window is not None else None
    offsets = np.arange(KEY_CHUNK)
    plans = []
    for j in range(-(-metadata.max_seq_len // KEY_CHUNK)):
        lo, hi = j * KEY_CHUNK, (j + 1) * KEY_CHUNK
        by_count: dict[int, list[tuple]] = defaultdict(list)
        for s, seq_len in enumerate(seq_lens):
            query_len = starts[s + 1] - starts[s]
            first_p, last_p = seq_len - query_len, seq_len - 1
            # rows with p >= lo, and (windowed) p - W + 1 < hi
            p0 = max(first_p, lo)
            p1 = last_p if window is None else min(last_p, hi + window - 2)
            if p0 > p1:
                continue
            positions = np.arange(p0, p1 + 1)
            rows = starts[s] + positions - first_p
            key_pos = lo + offsets
            first_visible = np.maximum(positions - window + 1, 0) if window is not None else np.zeros_like(positions)
            hidden = (key_pos[None, :] > positions[:, None]) | (key_pos[None, :] < first_visible[:, None])
            stale = hidden.all(axis=0)
            safe = np.clip(key_pos, 0, seq_len - 1)
            slots = table[s, safe // block_size] * block_size + safe % block_size
            by_count[len(rows)].append((rows, slots, stale, hidden))
        plans.append(
            [
                _Group(*(torch.from_numpy(np.stack([member[i] for member in members])).to(device) for i in range(4)))
                for members in by_count.values()
            ]
        )
    return plans
