"""The KV block pool: which of the worker's fixed-size cache blocks are free, and who holds them.

The scheduler owns the truth about blocks; the worker only writes into the block ids a
plan gives it. A block is either on the free list (reference count 0) or held (reference
count >= 1), never both, so ``num_free + num_held == total`` at all times.

Reference counts exist so that one block can later be shared by several requests with a
common prompt prefix. Prefix reuse is not built yet; when it is, a full block will also
carry a content hash (chained: hash of the previous block's hash and this block's token
ids), a hash -> block map will let a new request ``retain`` an existing block instead of
allocating one, and a freed block will keep its hash while it sits on the free list so it
can be revived until ``allocate`` hands it out again (evicting the hash). The free list is
a deque with freed blocks appended at the tail and allocations taken from the head, which
is already the least-recently-freed-first order that eviction will want.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class BlockPoolError(RuntimeError):
    """A caller broke the pool's contract (over-allocation, double free, unknown block)."""


class BlockPool:
    """Free list plus per-block reference counts over blocks ``0 .. total - 1``.

    ``allocate`` is all-or-nothing and *raises* :class:`BlockPoolError` when fewer than
    ``n`` blocks are free: the scheduler always checks :attr:`num_free` before it
    allocates, so running out here is a bug in the caller, not a policy signal.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount: list[int] = [0] * num_blocks

    @property
    def total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self._total - len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, only {len(self._free)} free")
        free, refcount = self._free, self._refcount
        blocks = [free.popleft() for _ in range(n)]
        for b in blocks:
            refcount[b] = 1
        return blocks

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks that are already held (for sharing a prefix later)."""
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
            if self._refcount[b] == 0:
                raise BlockPoolError(f"cannot retain free block {b}")
        for b in ids:
            self._refcount[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block back at 0 returns to the free list.

        Validated before anything changes, so a bad call (a double free, or the same
        block listed more times than it is referenced) raises and leaves the pool intact.
        """
        ids = list(block_ids)
        refcount = self._refcount
        if len(ids) > 1:
            for b, times in Counter(ids).items():
                self._check_id(b)
                if refcount[b] < times:
                    raise BlockPoolError(f"double free of block {b} (refcount {refcount[b]}, freed {times}x)")
        elif ids:
            self._check_id(ids[0])
            if refcount[ids[0]] < 1:
                raise BlockPoolError(f"double free of block {ids[0]}")
        for b in ids:
            refcount[b] -= 1
            if refcount[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        """Assert the pool's invariants; O(total), meant for tests and debugging."""
        free = list(self._free)
        free_set = set(free)
        assert len(free_set) == len(free), "a block is on the free list twice"
        held = [b for b in range(self._total) if self._refcount[b] > 0]
        assert not free_set.intersection(held), "a block is both free and held"
        assert all(self._refcount[b] == 0 for b in free), "a free block has references"
        assert all(self._refcount[b] >= 0 for b in range(self._total)), "negative reference count"
        assert len(free) + len(held) == self._total, (
            f"free {len(free)} + held {len(held)} != total {self._total}"
        )
        assert self.num_free + self.num_held == self._total

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._total:
            raise BlockPoolError(f"block id {block_id} outside the pool of {self._total}")
