"""The contract between the model and an attention implementation over the paged KV cache.

The model runs one flattened ragged batch per step: the new tokens of every scheduled
sequence laid end to end, ``T`` tokens in all, no padding. :class:`AttentionMetadata`
describes how those tokens split into sequences and where their keys and values live in
the block pool; every layer of the step reads the same metadata.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). Token ``p`` of a sequence lives in block ``block_table[p //
block_size]`` at offset ``p % block_size``, i.e. flat slot ``block_id * block_size + offset``.
An 8-bit cache (int8, float8_e4m3fn) holds scaled values: a backend stores and reads them by
:mod:`~conveyor.worker.attention.kv_quant`'s rule with the layer's :class:`KVScales`.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from conveyor.worker.attention.kv_quant import UNIT_SCALES, KVScales

if TYPE_CHECKING:
    from conveyor.worker.models.layers import RMSNorm, RotaryEmbedding


def token_positions(query_lens: Sequence[int], context_lens: Sequence[int]) -> np.ndarray:
    """Absolute position of every new token of the flattened batch, int64 ``[sum(query_lens)]``.

    Sequence ``i`` contributes ``context_lens[i] .. context_lens[i] + query_lens[i] - 1``.
    """
    query = np.asarray(query_lens, dtype=np.int64)
    starts = np.cumsum(query) - query
    offsets = np.asarray(context_lens, dtype=np.int64) - starts
    return np.arange(int(query.sum()), dtype=np.int64) + np.repeat(offsets, query)


@dataclass
class AttentionMetadata:
    """Where the new tokens of one step come from and go to. Shared by all layers of the step.

    Device tensors (on the model's device):
      ``query_start_loc`` int32 ``[B+1]``: sequence ``i``'s new tokens are rows
      ``query_start_loc[i]:query_start_loc[i+1]`` of the flattened batch.
      ``seq_lens`` int32 ``[B]``: tokens in context after this step (cached + new).
      ``context_lens`` int32 ``[B]``: tokens already cached before this step.
      ``block_tables`` int32 ``[B, max_blocks]``: the blocks holding positions
      ``0..seq_lens[i]-1``; entries past a sequence's last needed block are never read.
      ``slot_mapping`` int64 ``[T]``: flat cache slot of each new token, -1 = do not store.

    Host copies (``*_host``) let CPU backends loop over sequences without a device sync.
    Invariant: ``seq_lens == context_lens + diff(query_start_loc)``, every query length >= 1.
    ``uniform_query``: every sequence has exactly ``max_query_len`` new tokens (the static
    decode step's rows), which a backend may serve with its decode kernel.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int
    max_query_len: int
    block_size: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    uniform_query: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @functools.cached_property
    def stored_slots(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(rows, slots)``: the new tokens that are stored (None: every one, the usual case)
        and their slots, the non-negative entries of ``slot_mapping``; found once per step
        (the object is the step's) for every layer's store."""
        keep = self.slot_mapping >= 0
        if bool(keep.all()):
            return None, self.slot_mapping
        rows = keep.nonzero().squeeze(1)
        return rows, self.slot_mapping.index_select(0, rows)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]] | np.ndarray,
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Metadata for sequences with these new-token counts, cached-token counts and block tables.

        Each block table must cover ``context_len + query_len`` tokens; longer tables are
        cut to the blocks the step needs, so ``max_blocks`` tracks the longest context.
        ``block_tables`` is one list per sequence, or a 2-D integer array with a row per
        sequence (the model runner's persistent tables): the caller vouches that each row's
        first blocks cover its sequence.
        """
        query = np.asarray(query_lens, dtype=np.int64)
        context = np.asarray(context_lens, dtype=np.int64)
        seq = context + query
        blocks_needed = -(-seq // block_size)
        max_blocks = int(blocks_needed.max()) if len(seq) else 0
        if isinstance(block_tables, np.ndarray):
            if block_tables.shape[0] != len(seq) or block_tables.shape[1] < max_blocks:
                raise ValueError(
                    f"block tables of shape {block_tables.shape} for {len(seq)} sequences of up to {max_blocks} blocks"
                )
            table = block_tables[:, :max_blocks]
        else:
            table = np.zeros((len(seq), max_blocks), dtype=np.int64)
            for row, (blocks, needed) in enumerate(zip(block_tables, blocks_needed.tolist())):
                if len(blocks) < needed:
                    raise ValueError(f"sequence {row}: {len(blocks)} blocks cannot hold {int(seq[row])} tokens")
                table[row, :needed] = blocks[:needed]

        positions = token_positions(query, context)
        rows = np.repeat(np.arange(len(seq)), query)
        slots = table[rows, positions // block_size] * block_size + positions % block_size
        start_loc = np.concatenate([[0], np.cumsum(query)])

        def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype, non_blocking=True)

        return cls(
            query_start_loc=to_device(start_loc, torch.int32),
            seq_lens=to_device(seq, torch.int32),
            context_lens=to_device(context, torch.int32),
            block_tables=to_device(table, torch.int32),
            slot_mapping=to_device(slots, torch.int64),
            max_seq_len=int(seq.max()) if len(seq) else 0,
            max_query_len=int(query.max()) if len(query) else 0,
            block_size=block_size,
            query_start_loc_host=start_loc.tolist(),
            seq_lens_host=seq.tolist(),
        )


@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """One attention layer as a backend sees it: what every call for the layer reads.

    Built once by the model's attention module (this rank's heads under tensor parallelism)
    and rebuilt with its cache when that is bound, so a step passes one object per layer
    instead of the same half-dozen constants to each backend method.

    ``num_heads`` query heads share ``num_kv_heads`` kv heads in contiguous groups of
    :attr:`group`; ``scale`` multiplies the scores; a ``sliding_window`` W limits a query at
    position p to keys k > p - W (None: every earlier key); ``qk_norm`` is ``(q_norm,
    k_norm)``, applied per head before ``rotary`` (Qwen3). ``kv_cache`` is the layer's cache
    (laid out as this module's docstring says), None until bound; ``kv_scales`` the scales of
    its keys and values (an 8-bit cache's; 1 for a float cache).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    rotary: RotaryEmbedding
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None
    kv_cache: torch.Tensor | None = None
    kv_scales: KVScales = UNIT_SCALES

    @property
    def group(self) -> int:
        """Query heads per kv head: query head ``h`` reads kv head ``h // group``."""
        return self.num_heads // self.num_kv_heads

    @property
    def cache(self) -> torch.Tensor:
        """The bound KV cache layer."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound to the model")
        return self.kv_cache

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the fused projection ``qkv`` ``[T, (num_heads + 2 * num_kv_heads) * head_dim]``
        (query heads, then key heads, then value heads): query ``[T, num_heads, head_dim]``,
        key and value ``[T, num_kv_heads, head_dim]``."""
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        parts = qkv.split([n * self.head_dim for n in heads], dim=-1)
        query, key, value = (part.view(qkv.shape[0], n, self.head_dim) for part, n in zip(parts, heads))
        return query, key, value


class AttentionBackend(abc.ABC):
    """Attention over the paged KV cache for a flattened ragged batch.

    Per layer the model calls :meth:`rotate_and_store` with its fused q/k/v projection, which
    stores the new tokens' keys and values (:meth:`store_kv`), then :meth:`forward`, which
    reads every key/value of each sequence (cached prefix and new tokens alike) from the
    layer's cache.
    """

    @abc.abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        scales: KVScales = UNIT_SCALES,
    ) -> None:
        """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into their slots (-1 slots
        skipped), by ``scales`` into an 8-bit cache."""

    def rotate_and_store(
        self, layer: AttentionLayer, positions: torch.Tensor, qkv: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The step between the q/k/v projection ``qkv`` and attention; returns the query
        ``[T, num_heads, head_dim]`` to attend with.

        Normalizes query and key per head with the layer's ``qk_norm``, rotates both by their
        ``positions`` (together: their heads are adjacent in ``qkv``, so one rotation's few
        operators serve both) and stores the rotated keys and the values
        (:meth:`AttentionLayer.split`) in the layer's cache with :meth:`store_kv`. A backend
        with a fused kernel for all of it overrides this; the result must be the same up to
        rounding.
        """
        heads, dim = layer.num_heads, layer.head_dim
        query_key = qkv[:, : (heads + layer.num_kv_heads) * dim].view(qkv.shape[0], -1, dim)
        if layer.qk_norm is not None:
            q_norm, k_norm = layer.qk_norm
            query_key = torch.cat([q_norm(query_key[:, :heads]), k_norm(query_key[:, heads:])], dim=1)
        query_key = layer.rotary(positions, query_key)
        self.store_kv(query_key[:, heads:], layer.split(qkv)[2], layer.cache, metadata, layer.kv_scales)
        return query_key[:, :heads]

    @abc.abstractmethod
    def forward(self, layer: AttentionLayer, query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, num_heads, head_dim]`` over the layer's cache;
        returns ``[T, num_heads, head_dim]``.

        A new token at position ``p`` attends to positions ``k`` of its own sequence with
        ``k <= p`` and, given the layer's ``sliding_window`` ``W``, ``k > p - W``.
        """
