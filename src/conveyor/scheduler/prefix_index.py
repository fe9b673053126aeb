"""Content identity of full KV blocks, chained over the prefix, for prefix reuse.

The KV of a token depends on every token before it, so a block's identity is not its own
``block_size`` token ids but the whole prefix up to its end. Block ``i`` of a sequence is
therefore named by the pair ``(id of block i-1, token ids of block i)``, starting from
:data:`ROOT`, and this index interns each such pair into a small integer id: two requests
share block ``i`` exactly when their first ``(i + 1) * block_size`` tokens agree.

Interning rather than a digest: the dict hashes the pair (Python's tuple hash, a fraction
of a microsecond) and then compares it *exactly*, so a hash collision costs one more probe
and can never hand a request someone else's KV, without paying for a cryptographic hash
(BLAKE2b measured 1.5 us per block here; hashing every prefill block was then the largest
cost of a prefill-heavy iteration).

Ids are never reused. An id lives while some block pool (GPU or CPU) holds a block under it
(:meth:`PrefixIndex.retain` / :meth:`~PrefixIndex.release`); then the pair is forgotten.
A request may still remember a dead id in its chain: that only means its later blocks get
keys nobody else computes, i.e. no sharing, never a wrong match.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ROOT = 0  # the "previous block" of block 0


class PrefixIndex:
    """Interns ``(parent id, block tokens)`` pairs into ids, reference counted by the pools.

    A prefill-heavy iteration interns a block and forgets one per ``block_size`` tokens, so
    a request's blocks go through in one call (:meth:`intern_blocks`, :meth:`find_blocks`,
    :meth:`release`), and interning hashes each key once.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._keys: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._refs: dict[int, int] = {}
        self._next = ROOT + 1

    def __len__(self) -> int:
        return len(self._ids)

    def find(self, parent: int, tokens: Sequence[int]) -> int | None:
        """The id of this block content if some pool holds it, else None."""
        return self._ids.get((parent, tuple(tokens)))

    def find_blocks(self, tokens: Sequence[int], num_blocks: int, block_size: int, root: int = ROOT) -> list[int]:
        """The ids of the first full blocks of ``tokens`` (at most ``num_blocks``), up to the
        first whose content no pool holds: :meth:`find` along the chain, in one call. The chain
        starts from ``root``: :data:`ROOT` for the base model, a negative id per LoRA adapter
        (ids are positive, so chains of different roots never meet)."""
        ids = self._ids
        chain: list[int] = []
        parent = root
        for k in range(num_blocks):  # block by block, no copy up front: a lookup often ends at the first
            parent = ids.get((parent, tuple(tokens[k * block_size : (k + 1) * block_size])))
            if parent is None:
                break
            chain.append(parent)
        return chain

    def intern(self, parent: int, tokens: Sequence[int]) -> int:
        """The id of this block content, made up if new. A new id must be retained by the
        caller at once (a pool registering a block under it), or given back with :meth:`discard`."""
        return self.intern_blocks(parent, tokens, 0, 1, len(tokens))[0]

    def intern_blocks(self, parent: int, tokens: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
        """The chained ids of full blocks ``start .. end - 1`` of ``tokens``, block ``start``
        following the block of id ``parent``: :meth:`intern` for each, in one call."""
        ids, keys, refs = self._ids, self._keys, self._refs
        chain = []
        span = tuple(tokens[start * block_size : end * block_size])  # one copy; each block is then a tuple slice
        for k in range(end - start):
            key = (parent, span[k * block_size : (k + 1) * block_size])
            new = self._next
            parent = ids.setdefault(key, new)  # one hash of the key, found or inserted
            if parent == new:
                self._next = new + 1
                keys[new] = key
                refs[new] = 0
            chain.append(parent)
        return chain

    def retain(self, block_id: int) -> bool:
        """One more pool holds a block under this id; False (nothing changes) if the id is
        dead: a request's chain may name an id forgotten since, which must not come back."""
        refs = self._refs.get(block_id)
        if refs is None:
            return False
        self._refs[block_id] = refs + 1
        return True

    def release(self, block_ids: Iterable[int]) -> None:
        """One pool fewer holds a block under each of these ids; an id nobody holds is forgotten."""
        all_refs, ids, keys = self._refs, self._ids, self._keys
        for block_id in block_ids:
            refs = all_refs[block_id] - 1
            if refs:
                all_refs[block_id] = refs
            else:
                del all_refs[block_id]
                del ids[keys.pop(block_id)]

    def discard(self, block_id: int) -> None:
        """Forget an id that :meth:`intern` made up and nobody retained."""
        if self._refs.get(block_id) == 0:
            del self._refs[block_id]
            del self._ids[self._keys.pop(block_id)]

    def refs(self, block_id: int) -> int:
        """How many pools hold a block under this id (0 if it is not known)."""
        return self._refs.get(block_id, 0)

    def check(self, held: dict[int, int]) -> None:
        """Every live id is held exactly as often as ``held`` (id -> pools holding it) says."""
        assert self._refs == held, f"prefix index references out of sync: {self._refs} != {held}"
        assert len(self._ids) == len(self._keys) == len(self._refs)
