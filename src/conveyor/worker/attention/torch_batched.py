"""Paged attention in plain torch, batched over sequences: the CPU backend.

Computes what :class:`~conveyor.worker.attention.torch_ref.TorchReferenceAttention` computes
(float32 scores, softmax and weighted sum, the same mask), but for many sequences per torch
op instead of one, which is what makes a 256-sequence decode step cheap on a CPU.

How a step is cut up (once per step and sliding window; every layer reuses the plan):

* Each sequence's new tokens become one or more *tiles*: runs of at most ``rows_cap``
  consecutive query rows. A decode is one 1-row tile; a long prefill is split so that one
  tile's scores fit the scratch budget.
* Tiles are sorted by (rows, key blocks) and packed greedily into *groups*: a group pads
  every tile to its longest rows ``Q`` and key span ``L`` (whole blocks), holds at most
  ``scratch_bytes`` of keys and values (as gathered and in float32), scores and
  probabilities, and stops growing before padding would make it cost more than
  :data:`MAX_PADDING` times its tiles' own. So memory stays bounded whatever the batch (a
  4k-token prefill beside 255 decodes is a few tiles of the prefill, then the decodes in a
  few groups of similar lengths), and decodes never pad to a prefill's rows.
* Per group, one op each: gather the tiles' key blocks (``index_select`` through the block
  table, straight into kv-head-major ``[kv_heads * n, L, head_dim]``), a batched matmul for
  the scores, the mask as an added 0/-inf bias, softmax, then the weighted sum of values,
  and an ``index_copy_`` of the real rows into the output (an 8-bit cache is gathered as
stored and converted to float32; its layer's key scale multiplies the query and its value
scale the output: attention over the dequantized cache, up to rounding). Prefill groups gather the values
  like the keys and take a second batched matmul; decode groups over a float32 cache read
  the values with one ``embedding_bag`` (per query head, the sum of its value rows from the
  cache weighted by its probabilities), which never copies them: on a CPU this path is
  bound by memory traffic, and that saves a write and a read of every value.

The mask is the reference's: key position ``k`` is visible to a query at position ``p`` iff
``k <= p`` and, with a sliding window ``W``, ``k > p - W``. With a window, a tile's key
span starts at the block holding its first visible key rather than at 0. Padded query rows
repeat the tile's last row (they never attend to nothing; their output is dropped).

Key slots past a tile's last position (the tail of its last block, table columns past its
blocks, the other blocks a padded row reads) are hidden from every query, but an added
-inf does not hide a NaN there, nor does a zero probability hide an infinite value. So a
group whose output is not all finite is recomputed exactly: those slots zeroed, hidden
scores filled with -inf. Only a sequence's own non-finite keys or values can then show, as
in the reference, which never reads past a sequence's end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from conveyor.worker.attention.backend import AttentionLayer, AttentionMetadata
from conveyor.worker.attention.torch_ref import TorchStoreKV

#: Default scratch budget per group (bytes of keys+values, scores, probabilities). Between
#: 4 and 16 MiB made no measurable difference for demo-model decodes on a 2-core CPU; 1-2 MiB
#: (many small groups) was slower, as was no limit (more padding, worse cache use).
DEFAULT_SCRATCH_BYTES = 8 << 20
#: A group stops growing before its padded cost exceeds this multiple of its tiles' own.
MAX_PADDING = 1.25
#: Masks (as float32 0/-inf biases) are built once per step and kept for every layer up to
#: this many bytes in all, in plan order (decodes first); the rest are rebuilt per layer
#: from positions, so a long prefill's quadratic mask is never held whole.
MAX_KEPT_BIAS_BYTES = 16 << 20


@dataclass
class _Group:
    """Index tensors of one group of ``n`` tiles padded to ``rows`` query rows and ``keys`` key slots."""

    n: int
    rows: int
    keys: int
    blocks: torch.Tensor  # int64 [n * keys / block_size]: cache blocks, tile-major
    query_rows: torch.Tensor  # int64 [n * rows]: rows of the flattened batch (padding repeats the last)
    query_pos: torch.Tensor  # int64 [n, rows, 1]: position of each (padded) query row
    key_pos: torch.Tensor  # int64 [n, 1, keys]: position of each key slot
    bias: torch.Tensor | None  # float32 [n, rows, keys]: -inf where hidden, else 0 (None: build per call)
    stale: torch.Tensor | None  # bool [n, keys]: slots past the tile's last position (values zeroed)
    valid: torch.Tensor | None  # int64: which padded rows are real (None: all are)
    out_rows: torch.Tensor  # int64: where the real rows go in the output
    # Decodes over a float32 cache: per (kv head, tile, group, key slot) the value row
    # (slot * kv_heads + kv head) in the flat cache, and where each query's bag starts.
    value_rows: torch.Tensor | None = None
    value_offsets: torch.Tensor | None = None


class TorchBatchedAttention(TorchStoreKV):
    """:class:`AttentionBackend` in torch ops over whole groups of sequences (the CPU default).

    Keeps its scratch tensors (each at most ``scratch_bytes``; about that much in all for the
    keys, values, scores and probabilities) between calls and reuses them through ``out=``:
    fresh multi-megabyte tensors cost a page fault per 4 KiB page on every call, which
    measured as half of a 256-sequence decode's attention time (bench/attention_cpu.py).
    """

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        self.scratch_bytes = scratch_bytes
        # The step whose plans _plans holds: its metadata object and what the plans read of it.
        self._plans_for: tuple | None = None
        self._plans: dict[tuple, list[_Group]] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}

    def forward(self, layer: AttentionLayer, query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        kv_cache_layer = layer.cache
        _, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
        num_heads, group_size = layer.num_heads, layer.group
        out = torch.empty_like(query)
        if query.shape[0] == 0:
            return out
        groups = self._groups(metadata, layer)
        # [2, 1, kv_heads, num_blocks, block_size, head_dim]: a gather along blocks lands
        # kv-head-major. (The leading 1 matters: index_select over dim 1 of the 4-d view took
        # several times longer in torch 2.13 on CPU.)
        by_head = kv_cache_layer.permute(0, 3, 1, 2, 4).unsqueeze(1)
        f32, device = torch.float32, query.device
        k_scale, v_scale = layer.kv_scales.k, layer.kv_scales.v
        for g in groups:
            n, rows, keys = g.n, g.rows, g.keys
            batch = num_kv_heads * n  # bmm batch: (kv head, tile)
            gathered = (1, num_kv_heads, g.blocks.numel(), block_size, head_dim)
            key_t = self._gather("keys", by_head[0], g.blocks, gathered, device).view(batch, keys, head_dim)
            value_t = None
            if g.value_rows is None:
                value_t = self._gather("values", by_head[1], g.blocks, gathered, device).view(batch, keys, head_dim)
            q = self._buffer("q", (n * rows, num_heads, head_dim), query.dtype, device)
            torch.index_select(query, 0, g.query_rows, out=q)
            # [n, rows, kv_heads, group, dim] -> [kv_heads, n, group, rows, dim], float32, scaled
            q_by_head = self._buffer("q_by_head", (num_kv_heads, n, group_size, rows, head_dim), f32, device)
            q_by_head.copy_(q.view(n, rows, num_kv_heads, group_size, head_dim).permute(2, 0, 3, 1, 4))
            # (An 8-bit cache's key scale folds into the query's: q . (k * s) = (q * s) . k.)
            q_by_head = q_by_head.mul_(layer.scale * k_scale).view(batch, group_size * rows, head_dim)
            scores = self._buffer("scores", (batch, group_size * rows, keys), f32, device)
            probs = self._buffer("probs", (batch, group_size * rows, keys), f32, device)
            attended = self._buffer("attended", (batch, group_size * rows, head_dim), f32, device)
            bias = g.bias if g.bias is not None else _bias(g.query_pos, g.key_pos, layer.sliding_window)
            values = value_t if value_t is not None else (g.value_rows, g.value_offsets, kv_cache_layer[1])
            _attend(q_by_head, key_t, values, g, bias, False, scores, probs, attended, num_kv_heads, group_size)
            if not torch.isfinite(attended.sum()):  # (one reduction: NaN and inf carry into the sum)
                # Stale slots (hidden from every query) hold non-finite values: -inf bias plus
                # NaN, or 0 * inf, poisoned a row. Zero them and mask exactly, then only a
                # sequence's own non-finite keys/values can show, as in the reference.
                _attend(q_by_head, key_t, values, g, bias, True, scores, probs, attended, num_kv_heads, group_size)
            if v_scale != 1.0:  # (likewise the value scale: sum p (v * s) = (sum p v) * s)
                attended.mul_(v_scale)
            # [kv_heads, n, group, rows, dim] -> [n, rows, heads, dim] in the output's dtype
            result = self._buffer("result", (n, rows, num_kv_heads, group_size, head_dim), out.dtype, device)
            result.copy_(attended.view(num_kv_heads, n, group_size, rows, head_dim).permute(1, 3, 0, 2, 4))
            result = result.view(n * rows, num_heads, head_dim)
            if g.valid is not None:
                result = result.index_select(0, g.valid)
            out.index_copy_(0, g.out_rows, result)
        return out

    def _gather(
        self, name: str, cache: torch.Tensor, blocks: torch.Tensor, shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        """``cache`` ``[1, kv_heads, num_blocks, block_size, dim]`` at ``blocks`` (along dim 2), float32."""
        out = self._buffer(name, shape, cache.dtype, device)
        torch.index_select(cache, 2, blocks, out=out)
        if out.dtype != torch.float32:
            out = self._buffer(name + "32", shape, torch.float32, device).copy_(out)
        return out

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch tensor of ``shape`` (contents undefined), reusing the last one of that name.

        One bigger than ``scratch_bytes`` (a lone tile over budget, a large step's queries) is
        made for this call only, so the backend never holds more than a few budgets.
        """
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            if numel * buffer.element_size() <= self.scratch_bytes:
                self._scratch[key] = buffer
        return buffer[:numel].view(shape)

    def _groups(self, metadata: AttentionMetadata, layer: AttentionLayer) -> list[_Group]:
        """The step's groups, planned on the first layer that asks and reused by the rest.

        A step is one metadata object (the runner builds one per step and shares it between
        its layers); the plans are also dropped if its lengths or block table object change.
        Layers share a plan when their window, heads and cache dtype agree.
        """
        step = self._plans_for
        if (
            step is None
            or step[0] is not metadata
            or step[1] is not metadata.block_tables
            or step[2] != metadata.seq_lens_host
            or step[3] != metadata.query_start_loc_host
        ):
            self._plans = {}
            self._plans_for = (
                metadata,
                metadata.block_tables,
                list(metadata.seq_lens_host),
                list(metadata.query_start_loc_host),
            )
        cache_dtype = layer.cache.dtype
        key = (layer.sliding_window, layer.num_heads, layer.num_kv_heads, layer.head_dim, cache_dtype)
        if key not in self._plans:
            itemsize = torch.empty((), dtype=cache_dtype).element_size()
            # Scratch bytes per key slot of a tile (keys and values: as gathered, then float32)
            # and per (query row, key slot) (float32 scores and probabilities for every head).
            gathered_bytes = 4 + (itemsize if cache_dtype != torch.float32 else 0)
            per_key = 2 * layer.num_kv_heads * layer.head_dim * gathered_bytes
            per_score = 2 * 4 * layer.num_heads
            # Decodes over a float32 cache read values through embedding_bag (no gather).
            heads = (layer.num_kv_heads, layer.group) if cache_dtype == torch.float32 else None
            budget = self.scratch_bytes
            self._plans[key] = plan_groups(metadata, layer.sliding_window, per_key, per_score, budget, heads)
        return self._plans[key]


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    g: _Group,
    bias: torch.Tensor,
    exact: bool,
    scores: torch.Tensor,
    probs: torch.Tensor,
    attended: torch.Tensor,
    num_kv_heads: int,
    group_size: int,
) -> None:
    """Softmax attention of ``q`` ``[kv_heads * n, group * rows, dim]`` (scaled) over the
    gathered float32 ``keys`` ``[kv_heads * n, keys, dim]`` into ``attended``
    ``[kv_heads * n, group * rows, dim]``, through the ``scores`` and ``probs`` buffers.

    ``values`` is either gathered like ``keys``, or ``(rows, offsets, value_cache)``: then
    one ``embedding_bag`` sums each query's value rows straight from the cache, weighted by
    its probabilities (decodes; no copy of the values at all). Its rows never name a stale
    slot: a padded key slot's row is the tile's first key, with probability 0.

    Not ``exact``: adds the 0/-inf ``bias`` ``[n, rows, keys]`` (one cheap pass). ``exact``:
    first zeroes the stale slots of the gathered keys/values in place and fills hidden
    scores with -inf, whatever the stale slots held.
    """
    n, rows, num_keys = bias.shape
    if exact and g.stale is not None:
        for gathered in (keys, values):
            if isinstance(gathered, torch.Tensor):
                gathered.view(num_kv_heads, n, num_keys, -1).masked_fill_(g.stale[None, :, :, None], 0.0)
    torch.bmm(q, keys.transpose(1, 2), out=scores)
    by_query = scores.view(num_kv_heads, n, group_size, rows, num_keys)
    if exact:
        by_query.masked_fill_(bias[None, :, None] < 0, float("-inf"))
    else:
        by_query.add_(bias[None, :, None])
    torch.softmax(scores, dim=-1, out=probs)
    if isinstance(values, torch.Tensor):
        torch.bmm(probs, values, out=attended)
    else:
        value_rows, offsets, value_cache = values
        table = value_cache.reshape(-1, value_cache.shape[-1])  # [slots * kv_heads, dim], a view
        summed = F.embedding_bag(value_rows, table, offsets, mode="sum", per_sample_weights=probs.view(-1))
        attended.view(-1, attended.shape[-1]).copy_(summed)


def plan_groups(
    metadata: AttentionMetadata,
    sliding_window: int | None,
    per_key: int,
    per_score: int,
    budget: int,
    value_bag_heads: tuple[int, int] | None = None,
) -> list[_Group]:
    """Cut the step into tiles and pack them into groups of at most ``budget`` scratch bytes,
    where a group of ``n`` tiles padded to ``Q`` rows and ``L`` key slots costs
    ``n * L * (per_key + Q * per_score)``.

    A lone tile may exceed the budget: its keys and values alone may, and a prefill's tiles
    keep at least ``per_key // per_score`` rows, so that gathering a sequence's keys again
    for each of its tiles never costs more than the tiles' scores (a tile then takes at most
    twice its keys' and values' bytes). With ``value_bag_heads`` ``(kv_heads, group)``, groups
    of one-row tiles get the value rows and bag offsets for reading values by embedding_bag."""
    block_size = metadata.block_size
    starts = np.asarray(metadata.query_start_loc_host, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens_host, dtype=np.int64)
    query_lens = np.diff(starts)
    context_lens = seq_lens - query_lens

    # Tiles: sequence i's rows split into runs of at most rows_cap[i] (sized on its whole span).
    span = -(-seq_lens // block_size) * block_size
    rows_cap = np.maximum(max(1, per_key // per_score), (budget // span - per_key) // per_score)
    tiles_per_seq = -(-query_lens // rows_cap)
    seq = np.repeat(np.arange(len(seq_lens)), tiles_per_seq)
    first_tile = np.cumsum(tiles_per_seq) - tiles_per_seq
    r0 = (np.arange(len(seq)) - np.repeat(first_tile, tiles_per_seq)) * rows_cap[seq]
    r1 = np.minimum(r0 + rows_cap[seq], query_lens[seq])
    rows = r1 - r0
    first_row = starts[seq] + r0  # in the flattened batch
    first_pos = context_lens[seq] + r0
    end_pos = context_lens[seq] + r1  # keys needed: positions < end_pos
    if sliding_window is None:
        first_block = np.zeros_like(first_pos)
    else:
        first_block = np.maximum(first_pos - sliding_window + 1, 0) // block_size
    tile_blocks = -(-end_pos // block_size) - first_block

    groups: list[_Group] = []
    order = np.lexsort((tile_blocks, rows)).tolist()
    rows_list, blocks_list = rows.tolist(), tile_blocks.tolist()
    bias_left = MAX_KEPT_BIAS_BYTES
    begin = 0
    while begin < len(order):
        end, max_rows, max_blocks, real = begin, 0, 0, 0
        while end < len(order):
            t = order[end]
            new_rows, new_blocks = max(max_rows, rows_list[t]), max(max_blocks, blocks_list[t])
            new_real = real + blocks_list[t] * (per_key + rows_list[t] * per_score)
            padded = (end - begin + 1) * new_blocks * (per_key + new_rows * per_score)
            if end > begin and (padded * block_size > budget or padded > MAX_PADDING * new_real):
                break
            max_rows, max_blocks, real, end = new_rows, new_blocks, new_real, end + 1
        members = np.asarray(order[begin:end], dtype=np.int64)
        groups.append(
            _build_group(
                metadata,
                sliding_window,
                seq[members],
                rows[members],
                first_row[members],
                first_pos[members],
                end_pos[members],
                first_block[members],
                max_rows,
                max_blocks,
                keep_bias=bias_left >= len(members) * max_rows * max_blocks * block_size * 4,
                value_bag_heads=value_bag_heads if max_rows == 1 else None,
            )
        )
        if groups[-1].bias is not None:
            bias_left -= groups[-1].bias.numel() * 4
        begin = end
    return groups


def hidden_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Where a query at ``query_pos`` must not see the key at ``key_pos`` (broadcast): the
    reference's mask, negated."""
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    return hidden


def _bias(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """float32 ``[n, rows, keys]``: -inf where :func:`hidden_keys`, else 0."""
    hidden = hidden_keys(query_pos, key_pos, sliding_window)
    return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(hidden, float("-inf"))


def _build_group(
    metadata: AttentionMetadata,
    sliding_window: int | None,
    seq: np.ndarray,
    rows: np.ndarray,
    first_row: np.ndarray,
    first_pos: np.ndarray,
    end_pos: np.ndarray,
    first_block: np.ndarray,
    max_rows: int,
    max_blocks: int,
    keep_bias: bool,
    value_bag_heads: tuple[int, int] | None,
) -> _Group:
    block_size = metadata.block_size
    device = metadata.block_tables.device
    n, keys = len(seq), max_blocks * block_size

    row = np.minimum(np.arange(max_rows)[None, :], rows[:, None] - 1)  # [n, Q], padding repeats the last
    query_pos = first_pos[:, None] + row
    key_pos = first_block[:, None] * block_size + np.arange(keys)[None, :]  # [n, L]
    stale = key_pos >= end_pos[:, None]

    columns = np.minimum(first_block[:, None] + np.arange(max_blocks)[None, :], metadata.block_tables.shape[1] - 1)
    table = metadata.block_tables
    blocks = table[torch.from_numpy(seq).to(device)[:, None], torch.from_numpy(columns).to(device)]

    real = np.arange(max_rows)[None, :] < rows[:, None]  # [n, Q]
    all_real = bool(real.all())

    def dev(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    value_rows = value_offsets = None
    if value_bag_heads is not None:
        num_kv_heads, group_size = value_bag_heads
        # A stale slot's row becomes the tile's first key's (a slot it owns; probability 0).
        slot_in_block = torch.from_numpy(np.where(stale, 0, np.arange(keys)[None, :]))  # [n, L]
        slot_in_block = slot_in_block.to(device)
        tile_blocks = blocks.long().gather(1, slot_in_block // block_size)
        slots = tile_blocks * block_size + slot_in_block % block_size  # [n, L] flat cache slots
        heads = torch.arange(num_kv_heads, device=device)[:, None, None, None]
        value_rows = (slots[None, :, None, :] * num_kv_heads + heads).expand(num_kv_heads, n, group_size, keys)
        value_rows = value_rows.reshape(-1)
        value_offsets = torch.arange(0, value_rows.numel(), keys, device=device)

    query_pos_t, key_pos_t = dev(query_pos[:, :, None]), dev(key_pos[:, None, :])
    return _Group(
        n=n,
        rows=max_rows,
        keys=keys,
        blocks=blocks.reshape(-1).long(),
        query_rows=dev((first_row[:, None] + row).reshape(-1)),
        query_pos=query_pos_t,
        key_pos=key_pos_t,
        bias=_bias(query_pos_t, key_pos_t, sliding_window) if keep_bias else None,
        stale=dev(stale) if stale.any() else None,
        valid=None if all_real else dev(np.flatnonzero(real)),
        out_rows=dev((first_row[:, None] + np.arange(max_rows)[None, :])[real]),
        value_rows=value_rows,
        value_offsets=value_offsets,
    )
