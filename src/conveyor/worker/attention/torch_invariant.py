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
running softmax (maximum, sum, weighted values). Within a chunk, scores reduce over
``head_dim`` and the weighted sum over ``KEY_CHUNK`` slots (hidden slots weigh exactly 0),
both lengths fixed by the model. Which rows share a torch op changes only the ops' outer
(batch) dimension, which the tests check leaves each row's bits alone.
"""

from __future__ import annotations

import torch

from conveyor.worker.attention.backend import AttentionLayer, AttentionMetadata
from conveyor.worker.attention.torch_ref import TorchStoreKV

#: Key positions per chunk of the running softmax: every token's reductions run over chunks
#: of this many slots whatever its context, so the constant is part of the mode's numerics.
KEY_CHUNK = 64


class TorchInvariantAttention(TorchStoreKV):
    """:class:`AttentionBackend` on torch ops whose per-token result is batch-invariant."""

    def __init__(self) -> None:
        # The step the chunk plans were made for (its metadata object) and the plans by window.
        self._plans_for: AttentionMetadata | None = None
        self._plans: dict[int | None, list[_Chunk]] = {}

    def forward(self, layer: AttentionLayer, query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        cache = layer.cache
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        num_rows, group = query.shape[0], layer.group
        out = torch.empty_like(query)
        if num_rows == 0:
            return out
        keys = cache[0].reshape(-1, num_kv_heads, head_dim)
        values = cache[1].reshape(-1, num_kv_heads, head_dim)
        # [T, kv_heads, group, dim], float32, scaled
        q = query.float().view(num_rows, num_kv_heads, group, head_dim) * layer.scale
        best = torch.full((num_rows, num_kv_heads, group), float("-inf"), device=query.device)
        total = torch.zeros((num_rows, num_kv_heads, group), device=query.device)
        acc = torch.zeros((num_rows, num_kv_heads, group, head_dim), device=query.device)
        for chunk in self._chunks(metadata, layer.sliding_window, block_size):
            rows = chunk.rows
            k = keys[chunk.slots].float().transpose(1, 2)  # [n, kv_heads, C, dim]
            v = values[chunk.slots].float().transpose(1, 2)
            k = k.masked_fill(chunk.hidden[:, None, :, None], 0.0)  # stale slots may hold NaN
            v = v.masked_fill(chunk.hidden[:, None, :, None], 0.0)
            scores = torch.matmul(q[rows], k.transpose(-1, -2))  # [n, kv_heads, group, C]
            scores.masked_fill_(chunk.hidden[:, None, None, :], float("-inf"))
            old_best = best[rows]
            new_best = torch.maximum(old_best, scores.amax(dim=-1))
            # A row that has seen no visible key yet keeps -inf; shift by 0 there so that
            # exp(-inf - shift) is 0 rather than NaN.
            shift = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)
            probs = torch.exp(scores - shift[..., None])
            rescale = torch.exp(old_best - shift)
            best[rows] = new_best
            total[rows] = total[rows] * rescale + probs.sum(dim=-1)
            acc[rows] = acc[rows] * rescale[..., None] + torch.matmul(probs, v)
        out.copy_((acc / total[..., None]).view(num_rows, layer.num_heads, head_dim))
        return out

    def _chunks(self, metadata: AttentionMetadata, sliding_window: int | None, block_size: int) -> list[_Chunk]:
        """The step's chunk plans, made on the first layer that asks and reused by the rest."""
        if self._plans_for is not metadata:
            self._plans_for, self._plans = metadata, {}
        if sliding_window not in self._plans:
            self._plans[sliding_window] = plan_chunks(metadata, sliding_window, block_size)
        return self._plans[sliding_window]


class _Chunk:
    """One key chunk of a step: the rows that see a key in it, each row's ``KEY_CHUNK`` cache
    slots (hidden ones point at a slot of the row's own, any, and are masked) and the mask."""

    __slots__ = ("rows", "slots", "hidden")

    def __init__(self, rows: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        self.rows, self.slots, self.hidden = rows, slots, hidden


def plan_chunks(metadata: AttentionMetadata, sliding_window: int | None, block_size: int) -> list[_Chunk]:
    """For chunk ``j`` (key positions ``j*C .. j*C + C - 1``): the rows of the step whose
    visible keys (``k <= p``, and ``k > p - W`` with a window ``W``) meet it, with their slots."""
    device = metadata.block_tables.device
    starts = metadata.query_start_loc_host
    seq_index = torch.repeat_interleave(
        torch.arange(metadata.num_seqs, device=device), torch.diff(torch.tensor(starts, device=device))
    )
    positions = metadata.context_lens.long()[seq_index] + (
        torch.arange(starts[-1], device=device) - torch.tensor(starts[:-1], device=device)[seq_index]
    )
    first_visible = positions - sliding_window + 1 if sliding_window is not None else torch.zeros_like(positions)
    first_visible = first_visible.clamp(min=0)
    offsets = torch.arange(KEY_CHUNK, device=device)
    table = metadata.block_tables.long()
    plans = []
    for j in range(-(-metadata.max_seq_len // KEY_CHUNK)):
        lo = j * KEY_CHUNK
        rows = torch.nonzero((positions >= lo) & (first_visible < lo + KEY_CHUNK)).flatten()
        if rows.numel() == 0:
            continue
        p, first = positions[rows, None], first_visible[rows, None]
        key_pos = lo + offsets[None, :]
        hidden = (key_pos > p) | (key_pos < first)
        key_pos = torch.where(hidden, p, key_pos)  # a slot the row owns, masked anyway
        seq = seq_index[rows, None]
        slots = table[seq, key_pos // block_size] * block_size + key_pos % block_size
        plans.append(_Chunk(rows, slots, hidden))
    return plans
