"""A pool of fixed-size KV blocks: free list, reference counts, and the prefix cache.

The scheduler owns the truth about blocks; the worker only writes into the block ids a plan
gives it. The same class serves the GPU cache and the CPU swap space.

Every block is in exactly one of three states:

- **free**: reference count 0, no content worth keeping, on the free list;
- **cached**: reference count 0 but its contents are a known prefix (a full block under its
  content id from :class:`~conveyor.scheduler.prefix_index.PrefixIndex`, or a *partial*
  block: the first tokens of a block after a known parent), kept in an LRU so a later request with
  the same prefix can reuse it instead of recomputing it; evicted (oldest first) when nothing is
  free;
- **held**: reference count >= 1, one per request whose block table names it. A held full
  block may carry a content id too: other requests then share it by taking a reference.

so ``num_free + num_cached + num_held == total`` always. Only a held block can gain an id
(:meth:`register`, once its tokens are computed); an id names at most one block. Partial
entries exist only for cached blocks: a partial block is reused by *taking it over*
(:meth:`take`), since its new owner goes on writing into it; it is never shared.

Allocation takes the free list first (head: least recently freed), then evicts the least
recently cached block; ``on_evict`` hears about every full block evicted with its id (the
scheduler may copy it to the CPU tier before it is overwritten). Ids are registered in the
shared :class:`PrefixIndex`, which forgets an id once no pool holds it.

Cost: in a busy server every block a prefill computes is registered, and every block an
admission is given evicts a cached one, so these paths run once per ``block_size`` tokens.
They take a request's blocks in one call (:meth:`register_blocks`, :meth:`acquire_all`,
:meth:`lookup_prefix`, :meth:`free`, eviction), so the per-block work is a few list and
dict operations rather than a method call each.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from conveyor.scheduler.prefix_index import PrefixIndex


class BlockPoolError(RuntimeError):
    """A caller broke the pool's contract (over-allocation, double free, unknown block)."""


class BlockPool:
    """Blocks ``0 .. total - 1`` in the three states of the module docstring.

    ``allocate`` is all-or-nothing and *raises* :class:`BlockPoolError` when fewer than
    ``n`` blocks are free or cached: the scheduler checks :attr:`num_available` first, so
    running out here is a bug in the caller, not a policy signal.
    """

    def __init__(
        self,
        num_blocks: int,
        index: PrefixIndex | None = None,
        on_evict: Callable[[int, int], None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount: list[int] = [0] * num_blocks
        # Cached blocks, least recently released first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.index = index if index is not None else PrefixIndex()
        self._hash_of: list[int | None] = [None] * num_blocks  # content id of a full block
        self._block_of: dict[int, int] = {}
        # Partial blocks: block -> (parent id, its computed tokens); parent -> blocks.
        self._partial_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._partials: dict[int, set[int]] = {}
        self.on_evict = on_evict

    # ------------------------------------------------------------------ counts

    @property
    def total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks :meth:`allocate` can hand out: free plus cached (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_held(self) -> int:
        return self._total - len(self._free) - len(self._lru)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._lru

    # ------------------------------------------------------------------ allocation

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, each with reference count 1: free ones first, then evict. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        free = self._free
        if n > len(free) + len(self._lru):
            raise BlockPoolError(f"asked for {n} blocks, only {len(free) + len(self._lru)} free or cached")
        refcount = self._refcount
        if n <= len(free):
            blocks = [free.popleft() for _ in range(n)]
        else:
            blocks = list(free)
            free.clear()
            self._evict(n - len(blocks), blocks)
        for b in blocks:
            refcount[b] = 1
        return blocks

    def _evict(self, n: int, into: list[int]) -> None:
        """Evict the ``n`` least recently cached blocks into ``into``; the ids they held are
        released in one call."""
        lru, hash_of, block_of, on_evict = self._lru, self._hash_of, self._block_of, self.on_evict
        dropped = []
        for _ in range(n):
            block = lru.popitem(last=False)[0]
            h = hash_of[block]
            if h is not None:
                hash_of[block] = None
                del block_of[h]
                if on_evict is not None:
                    on_evict(block, h)  # before the release: a copy elsewhere keeps the id alive
                dropped.append(h)
            else:
                self._drop_partial(block)
            into.append(block)
        self.index.release(dropped)

    def acquire(self, block_id: int) -> None:
        """Add a reference to a held or cached full block (a prefix-cache hit revives a cached one)."""
        self.acquire_all((block_id,))

    def acquire_all(self, block_ids: Iterable[int]) -> None:
        """:meth:`acquire` each block (a request's prefix-cache hit, in one call). Validated
        before anything changes."""
        ids = list(block_ids)
        if not ids:
            return
        self._check_range(ids)
        refcount, lru, hash_of = self._refcount, self._lru, self._hash_of
        for b in ids:
            if not refcount[b] and (b not in lru or hash_of[b] is None):
                raise BlockPoolError(f"cannot acquire block {b}: it is neither held nor a cached full block")
        for b in ids:
            if not refcount[b]:
                del lru[b]
            refcount[b] += 1

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks that are already held. Validated before anything changes."""
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
            if self._refcount[b] == 0:
                raise BlockPoolError(f"cannot retain unreferenced block {b}")
        for b in ids:
            self._refcount[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; one back at 0 becomes cached if it has a hash, else free.

        A bad call (a double free, or the same block listed more times than it is
        referenced) raises and leaves the pool intact: references dropped before the bad
        one are restored, and no block changes state until all of them are dropped.
        """
        ids = list(block_ids)
        if not ids:
            return
        self._check_range(ids)
        refcount = self._refcount
        released = []
        for k, b in enumerate(ids):
            refs = refcount[b] - 1
            if refs < 0:
                for undo in ids[:k]:
                    refcount[undo] += 1
                raise BlockPoolError(f"double free of block {b} (listed {ids.count(b)}x)")
            refcount[b] = refs
            if not refs:
                released.append(b)
        hash_of = self._hash_of
        lru, free = self._lru, self._free
        for b in released:
            if hash_of[b] is not None:
                lru[b] = None
            else:
                free.append(b)

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, block_hash: int) -> int | None:
        """The block holding this full-block content id (held or cached), or None."""
        return self._block_of.get(block_hash)

    def lookup_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """The blocks holding the first ids of ``block_hashes``, up to the first this pool
        does not hold: :meth:`lookup` along a chain, in one call."""
        block_of = self._block_of
        blocks: list[int] = []
        for h in block_hashes:
            b = block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def count_cached(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks are cached (taking them uses up available blocks)."""
        lru = self._lru
        return sum(b in lru for b in block_ids)

    def registered_ids(self) -> list[int]:
        """Content ids this pool holds a block under (for index consistency checks)."""
        return list(self._block_of)

    def register(self, block_id: int, block_hash: int) -> bool:
        """Record that held block ``block_id`` now holds the full block of content id ``block_hash``.

        False (and nothing changes) when another block already holds that id, e.g. two
        requests computed the same prefix side by side: the later copy stays anonymous and
        is freed, not cached, when released; likewise when the id is dead (forgotten by
        the index). A block keeps the first id it gets.
        """
        if self._refcount[block_id] < 1:
            raise BlockPoolError(f"cannot register unreferenced block {block_id}")
        if self._hash_of[block_id] is not None:
            return self._hash_of[block_id] == block_hash
        if block_hash in self._block_of or not self.index.retain(block_hash):
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def register_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """:meth:`register` each block under the id at the same index (a chunk's full blocks,
        in one call). An id that no block took and nothing else holds is given back to the
        index (:meth:`PrefixIndex.discard`): it was made up for content cached elsewhere."""
        refcount, hash_of, block_of, index = self._refcount, self._hash_of, self._block_of, self.index
        for block_id, block_hash in zip(block_ids, block_hashes):
            if refcount[block_id] < 1:
                raise BlockPoolError(f"cannot register unreferenced block {block_id}")
            if hash_of[block_id] is None and block_hash not in block_of and index.retain(block_hash):
                hash_of[block_id] = block_hash
                block_of[block_hash] = block_id
            elif hash_of[block_id] != block_hash:
                index.discard(block_hash)

    def drop_cached(self) -> None:
        """Forget every cached block (freed, kept for the prefix cache): their contents no
        longer hold (new weights, a cache freed by sleep). Held blocks are the caller's to end first."""
        for block_id in list(self._lru):
            self.unregister(block_id)

    def unregister(self, block_id: int) -> None:
        """Forget what a block holds (its contents are not what its id says, e.g. the copy
        that was to fill it never ran). A cached block becomes free, also a cached partial
        one; a held one anonymous."""
        h = self._hash_of[block_id]
        if h is None:
            if block_id in self._partial_of:  # cached partial: its first tokens are not there either
                self._drop_partial(block_id)
                del self._lru[block_id]
                self._free.append(block_id)
            return
        self._hash_of[block_id] = None
        del self._block_of[h]
        self.index.release((h,))
        if self._refcount[block_id] == 0:
            del self._lru[block_id]
            self._free.append(block_id)

    def free_partial(self, block_id: int, parent: int, tokens: Sequence[int]) -> None:
        """Release the last reference to a partly filled, unhashed block, keeping it cached as
        "the first ``len(tokens)`` tokens ``tokens`` after prefix ``parent``"."""
        if self._refcount[block_id] != 1 or self._hash_of[block_id] is not None or not tokens:
            self.free([block_id])
            return
        self._refcount[block_id] = 0
        self._partial_of[block_id] = (parent, tuple(tokens))
        self._partials.setdefault(parent, set()).add(block_id)
        self._lru[block_id] = None

    def match_partial(self, parent: int, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The cached partial block after ``parent`` sharing the longest prefix with ``tokens``
        (``(block, matched token count)``, count >= 1), or None."""
        candidates = self._partials.get(parent)
        if not candidates:
            return None
        best: tuple[int, int] | None = None
        for block in candidates:
            stored = self._partial_of[block][1]
            n = 0
            for a, b in zip(stored, tokens):
                if a != b:
                    break
                n += 1
            if n and (best is None or n > best[1]):
                best = (block, n)
        return best

    def take(self, block_id: int) -> None:
        """Take over a cached partial block: it leaves the cache held once, to be written on."""
        if block_id not in self._partial_of or self._refcount[block_id] != 0:
            raise BlockPoolError(f"block {block_id} is not a cached partial block")
        self._drop_partial(block_id)
        del self._lru[block_id]
        self._refcount[block_id] = 1

    def _drop_partial(self, block_id: int) -> None:
        parent, _ = self._partial_of.pop(block_id)
        siblings = self._partials[parent]
        siblings.discard(block_id)
        if not siblings:
            del self._partials[parent]

    # ------------------------------------------------------------------ checking

    def check_invariants(self, expected_refcounts: dict[int, int] | None = None) -> None:
        """Assert the three-state invariant; with ``expected_refcounts`` (block -> count, as
        the callers' tables say), also that every held block has exactly that many
        references. O(total), meant for tests and debugging."""
        free = list(self._free)
        free_set = set(free)
        lru = set(self._lru)
        assert len(free_set) == len(free), "a block is on the free list twice"
        assert not free_set & lru, "a block is both free and cached"
        for b in range(self._total):
            ref = self._refcount[b]
            assert ref >= 0, f"negative reference count on block {b}"
            if b in free_set:
                assert ref == 0 and self._hash_of[b] is None and b not in self._partial_of, f"free block {b} has state"
            elif b in lru:
                assert ref == 0, f"cached block {b} has references"
                assert (self._hash_of[b] is None) != (b not in self._partial_of), f"cached block {b}: hash xor partial"
            else:
                assert ref > 0, f"block {b} is neither free, cached nor held"
                assert b not in self._partial_of, f"held block {b} has a partial entry"
            if expected_refcounts is not None:
                assert ref == expected_refcounts.get(b, 0), (
                    f"block {b}: refcount {ref}, but {expected_refcounts.get(b, 0)} holders"
                )
        for h, b in self._block_of.items():
            assert self._hash_of[b] == h, f"hash index out of sync at block {b}"
        assert sum(h is not None for h in self._hash_of) == len(self._block_of)
        for parent, blocks in self._partials.items():
            assert blocks and all(self._partial_of[b][0] == parent for b in blocks)
        assert sum(len(v) for v in self._partials.values()) == len(self._partial_of)
        assert self.num_free + self.num_cached + self.num_held == self._total

    def _check_range(self, block_ids: list[int]) -> None:
        """:meth:`_check_id` for a non-empty list, in two C-speed passes."""
        lo, hi = min(block_ids), max(block_ids)
        if lo < 0 or hi >= self._total:
            raise BlockPoolError(f"block id {lo if lo < 0 else hi} outside the pool of {self._total}")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._total:
            raise BlockPoolError(f"block id {block_id} outside the pool of {self._total}")
