from __future__ import annotations

import pytest

from conveyor.scheduler.block_pool import BlockPool, BlockPoolError
from conveyor.scheduler.prefix_index import ROOT, PrefixIndex


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8
    assert pool.num_free == 0 and pool.num_held == 8 and pool.total == 8
    pool.check_invariants()
    pool.free(a)
    assert pool.num_free == 3
    pool.free(b)
    assert pool.num_free == 8
    pool.check_invariants()


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(BlockPoolError):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_double_free_raises_and_leaves_pool_intact():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(BlockPoolError):
        pool.free([a[0]])
    b = pool.allocate(1)
    with pytest.raises(BlockPoolError):
        pool.free(b + b)  # the same block twice in one call
    assert pool.refcount(b[0]) == 1
    with pytest.raises(BlockPoolError):
        pool.free([99])
    pool.check_invariants()


def test_reference_counts_keep_shared_blocks_held():
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.retain([blk])
    pool.free([blk])
    assert pool.num_held == 1 and pool.refcount(blk) == 1
    pool.free([blk])
    assert pool.num_free == 2
    with pytest.raises(BlockPoolError):
        pool.retain([blk])
    pool.check_invariants()


def test_freed_blocks_are_reused_last():
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    pool.free([0])
    assert pool.allocate(2) == [1, 2]  # the freed block went to the tail of the free list
    assert pool.allocate(1) == [0]


# ---------------------------------------------------------------- prefix cache states


def test_registered_blocks_are_cached_when_released_and_revived_by_a_hit():
    index = PrefixIndex()
    pool = BlockPool(4, index)
    a, b = pool.allocate(2)
    content = index.intern(ROOT, [1, 2])
    assert pool.register(a, content) and pool.lookup(content) == a
    pool.free([a, b])
    assert (pool.num_free, pool.num_cached, pool.num_held) == (3, 1, 0)
    assert pool.is_cached(a) and index.refs(content) == 1
    pool.acquire(a)  # a prefix-cache hit
    assert pool.refcount(a) == 1 and pool.num_cached == 0
    pool.acquire(a)  # shared by a second request
    assert pool.refcount(a) == 2
    pool.check_invariants({a: 2})
    pool.free([a, a])
    pool.check_invariants({})


def test_an_id_names_one_block_and_dead_ids_never_come_back():
    index = PrefixIndex()
    pool = BlockPool(2, index)
    a, b = pool.allocate(2)
    content = index.intern(ROOT, [7])
    assert pool.register(a, content)
    assert not pool.register(b, content)  # the same content computed twice: b stays anonymous
    pool.free([a, b])
    assert pool.num_cached == 1 and pool.num_free == 1
    pool.allocate(2)  # evicts a: the index forgets the id
    assert index.refs(content) == 0 and index.find(ROOT, [7]) is None
    assert not index.retain(content)
    assert index.intern(ROOT, [7]) != content


def test_eviction_takes_free_blocks_first_then_the_least_recently_cached():
    index = PrefixIndex()
    evicted = []
    pool = BlockPool(3, index, on_evict=lambda block, content: evicted.append(block))
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.register(blk, index.intern(ROOT, [i]))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert pool.allocate(2) == [blocks[1], blocks[0]] and evicted == [blocks[1], blocks[0]]
    assert pool.lookup(index.find(ROOT, [2])) == blocks[2]
    with pytest.raises(BlockPoolError):
        pool.allocate(2)


def test_partial_blocks_are_taken_over_not_shared():
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.free_partial(blk, ROOT, [5, 6, 7])
    assert pool.num_cached == 1
    assert pool.match_partial(ROOT, [5, 6, 9, 9]) == (blk, 2)
    assert pool.match_partial(ROOT, [4]) is None and pool.match_partial(99, [5]) is None
    with pytest.raises(BlockPoolError):
        pool.acquire(blk)
    pool.take(blk)
    assert pool.refcount(blk) == 1 and pool.match_partial(ROOT, [5]) is None
    pool.check_invariants({blk: 1})


def test_a_bad_free_restores_the_references_it_dropped():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.retain([a])
    with pytest.raises(BlockPoolError):
        pool.free([a, b, c, c])  # c is referenced once
    assert [pool.refcount(x) for x in (a, b, c)] == [2, 1, 1]
    pool.check_invariants({a: 2, b: 1, c: 1})


def test_a_revived_block_takes_its_place_in_the_lru_from_its_last_release():
    index = PrefixIndex()
    pool = BlockPool(3, index)
    blocks = pool.allocate(3)
    pool.register_blocks(blocks, index.intern_blocks(ROOT, [1, 2, 3], 0, 3, 1))
    pool.free(blocks)  # cached, oldest first: blocks[0], blocks[1], blocks[2]
    pool.acquire_all([blocks[0]])  # a prefix hit revives it...
    pool.free([blocks[0]])  # ...and its release makes it the youngest
    pool.check_invariants()
    assert pool.allocate(2) == [blocks[1], blocks[2]]
    assert pool.is_cached(blocks[0]) and pool.num_cached == 1
    pool.check_invariants({blocks[1]: 1, blocks[2]: 1})


def test_acquire_all_is_validated_before_anything_changes():
    index = PrefixIndex()
    pool = BlockPool(3, index)
    a, b = pool.allocate(2)
    assert pool.register(a, index.intern(ROOT, [1]))
    pool.free([a, b])  # a cached, b free
    with pytest.raises(BlockPoolError):
        pool.acquire_all([a, b])
    assert pool.is_cached(a) and pool.refcount(a) == 0
    pool.check_invariants()


def test_chains_are_interned_and_found_a_request_at_a_time():
    index = PrefixIndex()
    tokens = list(range(10))
    chain = index.intern_blocks(ROOT, tokens, 0, 3, 3)  # blocks [0 1 2] [3 4 5] [6 7 8]
    one_by_one = [index.intern(ROOT, tokens[0:3])]
    for i in (1, 2):
        one_by_one.append(index.intern(one_by_one[-1], tokens[3 * i : 3 * i + 3]))
    assert chain == one_by_one and len(set(chain)) == 3
    assert index.intern_blocks(chain[0], tokens, 1, 3, 3) == chain[1:]
    assert index.find_blocks(tokens, 3, 3) == chain
    assert index.find_blocks([0, 1, 2, 3, 4, 9, 6, 7, 8], 3, 3) == chain[:1]  # stops at the first unknown block
    pool = BlockPool(4, index)
    blocks = pool.allocate(2)
    pool.register_blocks(blocks, chain[:2])
    assert pool.lookup_prefix(chain) == blocks  # the third is held by no block
