"""Masking the logits of constrained rows with their grammar bitmasks, on the device.

The bitmask (:mod:`conveyor.structured.matcher`: int32 words, bit ``i`` of word ``j`` allows
token ``32 * j + i``) has one row per logits row; only ``rows`` are read, so requests without
a constraint cost nothing but their untouched rows. Tokens past the bitmask's width (a model
vocabulary padded past the tokenizer's) are never allowed.

On CUDA, xgrammar's Triton kernel does it in one launch when xgrammar is installed (it reads
only the listed rows and writes only disallowed logits). Everywhere else one batched torch
pass does (:func:`_apply_torch`). Both set disallowed logits to ``-inf`` and leave the others
bit for bit as they were (logits are finite: a +inf logit would become NaN).

**The torch pass runs on the calling thread** (torch's intra-op parallelism off for its few
ops, :func:`_on_the_calling_thread`). On the CPU its arithmetic is small (16 rows of 4k tokens:
0.15 ms on one core) but it comes right after the host filled the mask, when torch's OpenMP
workers have gone idle: each parallel region then waits for a worker to be scheduled again,
10 to 30 ms on 2 cores shared with other work, and ``index_add_`` alone ran several regions.
That wait was most of the ~40 ms a step that structured output cost on the CPU benchmark
(docs/structured-output.md has the measurements). On CUDA the setting touches no kernel.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch


@functools.cache
def _xgrammar_kernel():
    """xgrammar's apply function, or None where it is not installed (it is optional)."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace


def backend_for(device: torch.device) -> str:
    """Which path masks logits on ``device``: ``"xgrammar-triton"`` or ``"torch"``."""
    return "xgrammar-triton" if device.type == "cuda" and _xgrammar_kernel() is not None else "torch"


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[r, t] = -inf`` for each ``r`` in ``rows`` and each token ``t`` its bitmask
    row disallows; in place. ``logits``: ``[batch, vocab]`` float; ``bitmask``: ``[batch,
    words]`` int32 on any device (copied to the logits' device if it is elsewhere)."""
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("expected logits [batch, vocab] and an int32 bitmask [batch, words]")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows")
    # Both copies non-blocking: a blocking one would wait for the step's forward (pageable
    # memory is staged before the call returns, so the host may refill its buffers at once).
    bitmask = bitmask.to(logits.device, non_blocking=True)
    index = torch.as_tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    if backend_for(logits.device) == "xgrammar-triton":
        vocab = min(logits.shape[1], bitmask.shape[1] * 32)
        _xgrammar_kernel()(logits, bitmask, vocab_size=vocab, indices=index, backend="triton")
        if vocab < logits.shape[1]:
            logits[index, vocab:] = float("-inf")
        return
    with _on_the_calling_thread():
        _apply_torch(logits, bitmask, index)


@contextlib.contextmanager
def _on_the_calling_thread() -> Iterator[None]:
    """torch's CPU ops inside run without intra-op parallelism (module docstring: why); the
    thread count is restored on the way out, exceptions included (a pair costs ~0.2 us)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: for each byte value, 0 where its bit is set and -inf where it is not."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Each int32 word is four little-endian bytes, byte ``k`` holding tokens ``8k .. 8k + 7``,
    so one lookup per byte turns the mask into an additive bias of 0 / -inf, added to the rows
    in one ``index_add_`` (x + 0 is x exactly; x + -inf is -inf). Measured ~10x faster on the
    CPU than expanding bits with shifts and ``masked_fill`` (a data-dependent select)."""
    vocab = logits.shape[1]
    data = bitmask.index_select(0, rows).contiguous().view(torch.uint8).long()
    bias = torch.nn.functional.embedding(data, _byte_bias(logits.device, logits.dtype)).flatten(1)
    if bias.shape[1] < vocab:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    logits.index_add_(0, rows, bias[:, :vocab])
