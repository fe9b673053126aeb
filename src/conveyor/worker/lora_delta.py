"""The adapters' delta of one step: every (fused) projection adds each token's ``B_s (A_s x)``.

One rule, two backends behind :meth:`LoraStack.add_delta`, chosen once per model by device
(like the attention backends), never per call and never by falling back:

- **torch** (CPU): :func:`build_batch` sorts tokens by slot on the host and lays them out as
  ``[P, L]`` (``P`` adapters present, ``L`` the most tokens of any of them, shorter segments
  padded and masked). Per stack: one gather of ``x``, a ``bmm`` shrink against the present
  slots' ``A``, a ``bmm`` expand against their ``B`` (block-diagonal for fused projections),
  the mask and an ``index_add_`` into the base output: five operators whatever the number of
  requests or adapters, at the cost of padding to the longest segment.
- **triton** (CUDA): :func:`conveyor.kernels.lora.segment_tiles` sorts the same way into
  tiles of one slot each, copied to the device in one transfer; per stack one shrink and one
  expand launch (:mod:`conveyor.kernels.lora`), no padding beyond a tile, and the expand
  reads each piece's own rank rows only (q/k/v and gate/up keep one launch each, not three).
  Triton missing on CUDA is an error when the stacks are made, not a silent torch path.

A step without adapter rows sets no batch (the host flag) and every stack returns at one
attribute test.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch


@dataclass
class LoraBatch:
    """The torch backend's step: ``slots`` ``[P]`` the present slots, ``gather`` ``[P, L]``
    token indices (padding: token 0), ``mask`` ``[P, L, 1]`` 1 on real entries, 0 on padding
    (whose delta is then zero, so adding it to token 0 is harmless)."""

    slots: torch.Tensor
    gather: torch.Tensor
    mask: torch.Tensor


@dataclass
class LoraSegments:
    """The Triton backend's step: ``tokens`` int32 the adapter tokens sorted by slot,
    ``tiles`` int32 ``[n, 3]`` ``(start, end, slot)`` into them, ``block`` tokens per tile."""

    tokens: torch.Tensor
    tiles: torch.Tensor
    block: int


def build_batch(token_slots: np.ndarray, dtype: torch.dtype, device: torch.device) -> LoraBatch | None:
    """Group tokens by slot (``token_slots[t]``, -1: none); None when no token has an adapter."""
    order = np.argsort(token_slots, kind="stable")
    ordered = token_slots[order]
    present, starts, counts = np.unique(ordered, return_index=True, return_counts=True)
    keep = present >= 0
    present, starts, counts = present[keep], starts[keep], counts[keep]
    if len(present) == 0:
        return None
    offsets = np.arange(int(counts.max()))
    valid = offsets[None, :] < counts[:, None]
    gather = np.where(valid, order[np.minimum(starts[:, None] + offsets[None, :], len(order) - 1)], 0)
    return LoraBatch(
        slots=torch.from_numpy(present.astype(np.int64)).to(device, non_blocking=True),
        gather=torch.from_numpy(gather.astype(np.int64)).to(device, non_blocking=True),
        mask=torch.from_numpy(valid[:, :, None]).to(device=device, dtype=dtype, non_blocking=True),
    )


def build_segments(token_slots: np.ndarray, device: torch.device, kernels: ModuleType) -> LoraSegments | None:
    """The Triton backend's grouping of ``token_slots``; None when no token has an adapter."""
    block = kernels.tile_tokens(len(token_slots))
    tokens, tiles = kernels.segment_tiles(token_slots, block)
    if len(tokens) == 0:
        return None
    both = torch.from_numpy(np.concatenate([tokens, tiles.ravel()])).to(device, non_blocking=True)
    return LoraSegments(both[: len(tokens)], both[len(tokens) :].view(-1, 3), block)


def triton_kernels() -> ModuleType:
    """:mod:`conveyor.kernels.lora`, or a clear error naming what LoRA on CUDA lacks."""
    try:
        from conveyor.kernels import lora
    except ImportError as error:
        raise RuntimeError(f"LoRA adapters on CUDA run Triton kernels, and they cannot be imported: {error}") from error
    return lora


class LoraContext:
    """The current step's grouping, shared by every stack (``batch`` None: no adapter rows),
    and the backend: ``triton`` (default: on CUDA) or torch. Tests force ``triton=True`` on
    CPU tensors with the kernels interpreted."""

    def __init__(self, device: torch.device, dtype: torch.dtype, triton: bool | None = None) -> None:
        self.device, self.dtype = device, dtype
        self.kernels = triton_kernels() if (device.type == "cuda" if triton is None else triton) else None
        self.batch: LoraBatch | LoraSegments | None = None

    def begin(self, token_slots: np.ndarray) -> None:
        """Group the step's tokens (slot per token, -1: base) for the backend."""
        if self.kernels is None:
            self.batch = build_batch(token_slots, self.dtype, self.device)
        else:
            self.batch = build_segments(token_slots, self.device, self.kernels)


class LoraStack:
    """The stacked adapter weights of one (fused) projection: ``a`` ``[slots, R, in]``,
    ``b`` ``[slots, out, R]`` with ``R = len(columns) * rank``: piece ``p`` writes output
    columns ``columns[p]`` from rank rows ``p*rank .. (p+1)*rank`` (B is zero elsewhere).
    A plain object, not a module: its tensors are neither parameters nor buffers, so the base
    checkpoint's strict loader and state dict never see them."""

    def __init__(
        self,
        slots: int,
        rank: int,
        columns: list[tuple[int, int]],
        in_features: int,
        out_features: int,
        context: LoraContext,
    ) -> None:
        rank_rows = len(columns) * rank
        self.a = torch.zeros(slots, rank_rows, in_features, dtype=context.dtype, device=context.device)
        self.b = torch.zeros(slots, out_features, rank_rows, dtype=context.dtype, device=context.device)
        self.columns = torch.tensor(columns, dtype=torch.int32, device=context.device)
        self.widest = max(last - first for first, last in columns)
        self.context = context

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each token's ``B_s (A_s x)`` for its slot ``s`` (in place; ``y`` returned)."""
        batch = self.context.batch
        if batch is None:
            return y
        if isinstance(batch, LoraSegments):
            kernels = self.context.kernels
            shrunk = kernels.lora_shrink(x, self.a, batch.tokens, batch.tiles, batch.block)
            return kernels.lora_expand(
                shrunk, self.b, y, batch.tokens, batch.tiles, self.columns, self.widest, batch.block
            )
        xs = x[batch.gather]  # [P, L, in]
        shrunk = torch.bmm(xs, self.a.index_select(0, batch.slots).transpose(1, 2)) * batch.mask
        delta = torch.bmm(shrunk, self.b.index_select(0, batch.slots).transpose(1, 2))  # [P, L, out]
        return y.index_add_(0, batch.gather.flatten(), delta.flatten(0, 1))
