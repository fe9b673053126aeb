"""A request's grammar state, and the batched filling of next-token bitmasks.

The bitmask layout is the one llguidance and xgrammar share: ``int32[rows, ceil(V / 32)]``,
bit ``i`` of word ``j`` set when token ``32 * j + i`` is allowed. Filling runs on the CPU,
next to the sampler (the worker fills step N's rows while step N's forward runs, once step
N-1's tokens are accepted); applying it to the logits is :mod:`conveyor.worker.grammar_mask`.

A row with no allowed token is a dead end: the request cannot continue and must end with its
own finish reason. The engine, once it has failed (a token it did not allow was forced on it),
allows only end-of-sequence, which would read as a normal stop; so a failed matcher counts as a
dead end too, never as a row to sample from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask buffer, every token allowed (the value of rows no matcher fills)."""
    return np.full((rows, bitmask_width(vocab_size)), -1, dtype=np.int32)


class GrammarMatcher:
    """One request's position in its grammar. Made by :meth:`CompiledGrammar.matcher`; advanced
    with every token the request keeps; rolled back when a speculative token is rejected."""

    __slots__ = ("_m",)

    def __init__(self, ll_matcher: Any) -> None:
        self._m = ll_matcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and :attr:`error` set, for good) if the grammar forbids it."""
        return self._m.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected draft tokens)."""
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    def fill(self, bitmask: np.ndarray, row: int) -> bool:
        """Write this request's allowed next tokens into ``bitmask[row]``; False at a dead end."""
        view = bitmask[row]
        if bitmask.dtype != np.int32 or not view.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask must be a C-contiguous int32 array")
        self._m.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
        return not self._m.is_error() and bool(view.any())

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or failed): nothing but end-of-sequence may follow."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a whole match: ending here (end-of-sequence) is allowed."""
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        """Why the matcher failed ('' while it has not): for the request's finish message."""
        return self._m.get_error()


def fill_rows(rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> list[int]:
    """Fill ``bitmask[row]`` for every ``(matcher, row)`` of a step's constrained requests;
    returns the rows that are dead ends. One row after another on the calling thread, not on
    llguidance's executor: its pool thread is one more thread the OS must wake and schedule
    beside torch's (measured on 2 loaded CPU cores: 2 to 11 ms a step for 16 rows through the
    executor's one thread, 0.7 ms on the caller; docs/structured-output.md)."""
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError("bitmask must be a C-contiguous 2-D int32 array")
    return [row for m, row in rows if not m.fill(bitmask, row)]
