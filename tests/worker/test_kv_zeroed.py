"""The KV pool's zeros on the CPU (conveyor.worker.kv_cache.zeroed): zeros whatever the memory
held before, at every size and dtype the caches use, in a storage sleep can still shrink and regrow."""

from __future__ import annotations

import mmap

import pytest
import torch

from conveyor.worker.kv_cache import KVCacheShape, _pages_dropped, zeroed

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 4097, (1 << 20) + 13, (3 << 20) + 1])
def test_zeroed_is_zeros(dtype, numel):
    tensor = zeroed((numel,), dtype, "cpu")
    assert tensor.shape == (numel,) and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.view(torch.uint8).any()
    storage = tensor.untyped_storage()  # as sleep shrinks and regrows it
    storage.resize_(0)
    storage.resize_(numel * tensor.element_size())


def test_dropped_pages_read_as_zeros_after_holding_data():
    """The memory madvise gives back held ones (a heap reused): it reads as zeros after."""
    dirty = torch.ones(8 << 20, dtype=torch.uint8)
    start = -(-dirty.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    length = (4 << 20) // mmap.PAGESIZE * mmap.PAGESIZE
    offset = start - dirty.data_ptr()
    assert _pages_dropped(start, length)
    assert not dirty[offset : offset + length].any()
    assert dirty[:offset].all() and dirty[offset + length :].all()  # the pages around kept their data


def test_kv_pool_and_swap_space_start_zeroed():
    shape = KVCacheShape(num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    torch.ones(1 << 22).neg_()  # memory the allocator may hand out again
    caches = shape.allocate(600, "cpu")
    swap = shape.allocate_swap(300, "cpu")
    assert [c.shape for c in caches] == [shape.layer_shape(600)] * 3
    assert [s.shape for s in swap] == [shape.layer_shape(300)] * 3
    assert not any(t.any() for t in (*caches, *swap))
    caches[1][0, 5].fill_(2.0)  # views of one allocation, each layer its own range
    assert caches[1].sum() == 2.0 * 16 * 2 * 64 and caches[0].sum() == 0 and caches[2].sum() == 0
