"""Persistent inputs of the static-buffer decode step: one host staging area, one device copy.

Every input of a decode step is a view into one device byte buffer, filled from a (pinned)
host staging buffer of the same layout in one copy, so nothing is allocated or awaited and a
CUDA graph captured over the views replays with each step's inputs (docs/architecture.md,
"The decode step's buffers").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

#: (name, dtype, shape kind): ``row`` one per row, ``token`` one per query token (``q`` per
#: row, row-major), ``table`` ``W`` per row. int64 first so every field stays naturally aligned.
FIELDS: tuple[tuple[str, np.dtype, str], ...] = (
    ("input_ids", np.dtype(np.int64), "token"),
    ("positions", np.dtype(np.int64), "token"),
    ("slot_mapping", np.dtype(np.int64), "token"),
    # The hidden rows the LM head scores, in this order: each row's last real token (the one it
    # samples after), then each row's first q - 1 tokens (a verify step's proposal positions).
    ("logit_index", np.dtype(np.int64), "token"),
    ("target_index", np.dtype(np.int64), "token"),  # first t: the scored rows at real proposal positions
    ("last_slots", np.dtype(np.int64), "row"),  # the row's slot in the runner's last-token buffer
    ("sample_rows", np.dtype(np.int64), "row"),  # first n: the rows that sample, in result order
    ("sample_slots", np.dtype(np.int64), "row"),  # their slots
    ("control_rows", np.dtype(np.int64), "row"),  # first c: the sampling rows using sampling controls
    ("control_pool_rows", np.dtype(np.int64), "row"),  # their rows in the controls' pool
    ("seed", np.dtype(np.int64), "row"),
    ("top_k", np.dtype(np.int64), "row"),
    ("seq_lens", np.dtype(np.int32), "row"),
    ("context_lens", np.dtype(np.int32), "row"),
    ("block_tables", np.dtype(np.int32), "table"),
    ("temperature", np.dtype(np.float32), "row"),
    ("top_p", np.dtype(np.float32), "row"),
    ("min_p", np.dtype(np.float32), "row"),
    ("from_device", np.dtype(np.bool_), "row"),  # the row's first input is the token the step in flight samples
    ("seeded", np.dtype(np.bool_), "row"),
)

_TORCH = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


def decode_buckets(max_rows: int) -> list[int]:
    """Row counts decode steps are padded to: 1, 2, 4, 8, 16, 24, 32, then every 16, with
    ``max_rows`` itself last (so a full batch pads nothing)."""
    buckets = [b for b in (1, 2, 4, 8, 16, 24, 32) if b < max_rows]
    size = 48
    while size < max_rows:
        buckets.append(size)
        size += 16
    return buckets + [max_rows]


def context_buckets(max_context: int, smallest: int = 512) -> list[int]:
    """Upper bounds of a decode step's longest context that fix its split-K partitioning:
    ``smallest`` times powers of 4, then ``max_context``."""
    bounds = []
    bound = smallest
    while bound < max_context:
        bounds.append(bound)
        bound *= 4
    return bounds + [max_context]


def smallest_fitting(buckets: list[int], value: int) -> int:
    """The first of the increasing ``buckets`` that is at least ``value`` (the last one's
    caller guarantees it fits)."""
    for bucket in buckets:
        if bucket >= value:
            return bucket
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


@functools.cache
def _layout(rows: int, width: int, q: int) -> tuple[dict[str, tuple[int, np.dtype, tuple[int, ...]]], int]:
    """Each field's (byte offset, dtype, shape) in a bucket of ``rows`` rows of ``q`` query
    tokens and ``width`` table columns, and the bucket's size in bytes (computed once per
    bucket: every step asks)."""
    shapes = {"row": (rows,), "token": (rows * q,), "table": (rows, width)}
    fields = {}
    offset = 0
    for name, dtype, kind in FIELDS:
        shape = shapes[kind]
        fields[name] = (offset, dtype, shape)
        offset += -(-int(np.prod(shape)) * dtype.itemsize // 8) * 8
    return fields, offset


@dataclass
class DecodeInputs:
    """Device views of one bucket's inputs (field name -> tensor), fixed for the buffers' life."""

    rows: int
    query_len: int  # q: query tokens per row (1 + the verify width k)
    tensors: dict[str, torch.Tensor]
    query_start_loc: torch.Tensor  # int32 [rows + 1]: 0, q, 2q, ... (q tokens per row)

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(name) from None


class StepBuffers:
    """The decode step's device input buffer and its host staging, for steps padded to one of
    ``buckets`` rows, of up to ``max_query_len`` query tokens per row and up to ``width``
    block-table columns per row (fixed: the views graphs capture never move).
    A step's table width is its context bucket's (``ceil(bound / block_size)``), so a short-
    context step copies a narrow table."""

    def __init__(self, buckets: list[int], width: int, device: torch.device, max_query_len: int = 1) -> None:
        self.buckets = buckets  # increasing row counts a step pads to; the last is the most rows
        self.max_rows = max_rows = buckets[-1]
        self.width = width
        self.device = device
        _, size = _layout(max_rows, width, max_query_len)
        cuda = device.type == "cuda"
        self._device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self._host_bytes = [torch.zeros(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self._copied = [None, None]  # per host buffer: event recorded after its last copy (CUDA)
        self._next = 0
        self._inputs: dict[tuple[int, int, int], DecodeInputs] = {}
        self._host_views: list[dict[tuple[int, int, int], dict[str, np.ndarray]]] = [{}, {}]
        self._cuda = cuda

    def bucket_for(self, rows: int) -> int:
        return smallest_fitting(self.buckets, rows)

    def inputs(self, rows: int, width: int, q: int = 1) -> DecodeInputs:
        """Device views of bucket ``rows`` with ``q`` query tokens per row and ``width``
        block-table columns (made once each)."""
        inputs = self._inputs.get((rows, width, q))
        if inputs is None:
            fields, _ = _layout(rows, width, q)
            tensors = {}
            for name, (offset, dtype, shape) in fields.items():
                nbytes = int(np.prod(shape)) * dtype.itemsize
                tensors[name] = self._device_bytes[offset : offset + nbytes].view(_TORCH[dtype]).view(shape)
            start_loc = torch.arange(0, rows * q + 1, q, dtype=torch.int32, device=self.device)
            inputs = self._inputs[rows, width, q] = DecodeInputs(rows, q, tensors, start_loc)
        return inputs

    def stage(self, rows: int, width: int, q: int = 1) -> dict[str, np.ndarray]:
        """Host views of bucket ``rows`` (``q`` query tokens per row, ``width`` table columns)
        in the next staging buffer, every row set to padding; the caller fills the real rows,
        then calls :meth:`upload` with the same arguments."""
        k = self._next
        if self._copied[k] is not None:
            self._copied[k].synchronize()  # its previous copy (two steps back) has long run
        views = self._host_views[k].get((rows, width, q))
        if views is None:
            fields, _ = _layout(rows, width, q)
            raw = self._host_bytes[k].numpy()
            views = {
                name: raw[offset : offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
                for name, (offset, dtype, shape) in fields.items()
            }
            self._host_views[k][rows, width, q] = views
        _pad(views, q)
        return views

    def upload(self, rows: int, width: int, q: int = 1) -> DecodeInputs:
        """Copy the staged bucket to the device (one copy, not waited for) and return its views."""
        k = self._next
        self._next = 1 - k
        _, size = _layout(rows, width, q)
        self._device_bytes[:size].copy_(self._host_bytes[k][:size], non_blocking=self._cuda)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._copied[k] = event
        return self.inputs(rows, width, q)


def _pad(views: dict[str, np.ndarray], q: int) -> None:
    """Every row inert (see the module docstring)."""
    for name in (
        "input_ids",
        "positions",
        "logit_index",
        "target_index",
        "last_slots",
        "sample_rows",
        "sample_slots",
        "control_rows",
        "control_pool_rows",
        "seed",
        "top_k",
        "context_lens",
    ):
        views[name].fill(0)
    views["slot_mapping"].fill(-1)
    views["seq_lens"].fill(q)
    views["block_tables"].fill(0)
    views["temperature"].fill(0.0)
    views["top_p"].fill(1.0)
    views["min_p"].fill(0.0)
    views["from_device"].fill(False)
    views["seeded"].fill(False)
