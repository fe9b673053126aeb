from __future__ import annotations

import pytest

from conveyor.scheduler.block_pool import BlockPool, BlockPoolError


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
