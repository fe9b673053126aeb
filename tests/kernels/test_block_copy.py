"""Block copy (copy-on-write inside a cache) and block swap (between caches, across devices).

Every check compares whole caches bit for bit: the listed destination blocks must hold their
sources' K and V, and every other block of every layer must be untouched.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.block_copy import (
    _swap_staged,
    copy_blocks,
    copy_blocks_ref,
    stacked,
    swap_blocks,
    swap_blocks_ref,
)
from conveyor_tools.kernels.testing import random_kv_cache


def _layers(gen, device, n_layers, num_blocks, block_size=16, kv_heads=2, head_dim=64, dtype=torch.float32):
    return [
        random_kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device, generator=gen)
        for _ in range(n_layers)
    ]


def _random_pairs(gen, num_blocks: int, n: int) -> tuple[list[int], list[int]]:
    """``n`` sources and ``n`` distinct destinations, disjoint from the sources."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    dst = order[:n]
    src = [order[n + int(i)] for i in torch.randint(0, num_blocks - n, (n,), generator=gen)]
    return src, dst


@pytest.mark.parametrize(
    ("n_layers", "num_blocks", "n_pairs", "block_size", "kv_heads", "head_dim", "dtype"),
    [
        (1, 10, 1, 8, 1, 64, torch.float32),
        (3, 40, 7, 16, 2, 80, torch.float32),
        (2, 30, 5, 32, 4, 96, torch.bfloat16),  # 16 Ki elements per half-block: several chunks
        (2, 25, 3, 16, 8, 256, torch.float16),
    ],
)
def test_copy_blocks_moves_exactly_the_listed_blocks(
    device, gen, n_layers, num_blocks, n_pairs, block_size, kv_heads, head_dim, dtype
) -> None:
    layers = _layers(gen, device, n_layers, num_blocks, block_size, kv_heads, head_dim, dtype)
    src, dst = _random_pairs(gen, num_blocks, n_pairs)
    pairs = torch.tensor(list(zip(src, dst)), dtype=torch.int64, device=device)
    before = [kv.clone() for kv in layers]
    want = copy_blocks_ref(layers, pairs)

    copy_blocks(layers, pairs)

    for kv, old, ref in zip(layers, before, want):
        assert torch.equal(kv, ref)
        changed = (kv != old).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) <= set(dst)  # nothing outside the destinations moved
        for s, d in zip(src, dst):
            assert torch.equal(kv[:, d], old[:, s])


def test_copy_blocks_single_tensor_and_empty(device, gen) -> None:
    kv = _layers(gen, device, 1, 6)[0]
    before = kv.clone()
    copy_blocks(kv, torch.empty((0, 2), dtype=torch.int64, device=device))
    assert torch.equal(kv, before)
    copy_blocks(kv, torch.tensor([[4, 1]], device=device))
    assert torch.equal(kv[:, 1], before[:, 4])
    assert torch.equal(kv[:, [0, 2, 3, 4, 5]], before[:, [0, 2, 3, 4, 5]])


@pytest.mark.parametrize("max_staging_bytes", [1, 3 * 2 * 16 * 2 * 64 * 4 * 2, 1 << 30])
def test_staged_swap_path_chunks_correctly(gen, max_staging_bytes) -> None:
    """The cross-device gather/transfer/scatter path, run host to host so it is covered without a
    GPU; staging caps of one block, two blocks and everything."""
    src = _layers(gen, "cpu", 3, 20)
    dst = _layers(gen, "cpu", 3, 12)
    src_ids, dst_ids = [5, 0, 19, 7, 11], [2, 9, 0, 11, 4]
    want = swap_blocks_ref(src, dst, src_ids, dst_ids)
    _swap_staged(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids), max_staging_bytes)
    for d, w in zip(dst, want):
        assert torch.equal(d, w)


def test_swap_same_device(device, gen) -> None:
    src = _layers(gen, device, 2, 9)
    dst = _layers(gen, device, 2, 7)
    want = swap_blocks_ref(src, dst, [8, 1, 3], [0, 6, 2])
    swap_blocks(src, dst, torch.tensor([8, 1, 3]), [0, 6, 2])
    for d, w in zip(dst, want):
        assert torch.equal(d, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_swap_out_and_in_across_devices(gen) -> None:
    """GPU -> pinned CPU swap space and back restores exactly the swapped blocks."""
    gpu = _layers(gen, "cuda", 3, 32, dtype=torch.bfloat16)
    cpu = [t.pin_memory() for t in _layers(gen, "cpu", 3, 16, dtype=torch.bfloat16)]
    gpu_ids, cpu_ids = [3, 17, 30, 8], [15, 0, 7, 9]
    want_cpu = swap_blocks_ref(gpu, cpu, gpu_ids, cpu_ids)
    swap_blocks(gpu, cpu, gpu_ids, cpu_ids, max_staging_bytes=1)  # also chunked
    for c, w in zip(cpu, want_cpu):
        assert torch.equal(c, w)

    back_ids = [1, 2, 31, 4]
    want_gpu = swap_blocks_ref(cpu, gpu, cpu_ids, back_ids)
    swap_blocks(cpu, gpu, torch.tensor(cpu_ids), torch.tensor(back_ids, device="cuda"))
    torch.cuda.synchronize()
    for g, w in zip(gpu, want_gpu):
        assert torch.equal(g, w)


def test_swap_rejects_mismatched_layers(gen) -> None:
    src = _layers(gen, "cpu", 2, 4)
    with pytest.raises(ValueError):
        swap_blocks(src, src[:1], [0], [1])
    other = _layers(gen, "cpu", 2, 4, head_dim=80)
    with pytest.raises(ValueError):
        swap_blocks(src, other, [0], [1])


def _stacked_layers(gen, device, n_layers, num_blocks, block_size=16, kv_heads=2, head_dim=64, dtype=torch.float32):
    """Layers as views of one [layers, 2, num_blocks, ...] tensor, the worker's layout."""
    whole = torch.randn((n_layers, 2, num_blocks, block_size, kv_heads, head_dim), generator=gen).to(device, dtype)
    return list(whole.unbind(0))


def test_copy_blocks_moves_every_layer_of_a_stack_in_one_launch(device, gen, monkeypatch) -> None:
    from conveyor.kernels import block_copy

    layers = _stacked_layers(gen, device, 4, 20, dtype=torch.bfloat16)
    assert block_copy.stacked(layers).shape == (4, *layers[0].shape)
    src, dst = _random_pairs(gen, 20, 6)
    pairs = torch.tensor(list(zip(src, dst)), dtype=torch.int64, device=device)
    want = copy_blocks_ref(layers, pairs)
    launches = []
    launch = block_copy._launch_copy_blocks
    monkeypatch.setattr(block_copy, "_launch_copy_blocks", lambda *a: (launches.append(a), launch(*a))[1])
    copy_blocks(layers, pairs)
    assert len(launches) == (1 if device.type == "cuda" or block_copy.interpreting() else 0)
    for kv, ref in zip(layers, want):
        assert torch.equal(kv, ref)


def test_swap_between_stacked_caches_moves_runs_and_scattered_blocks(gen) -> None:
    """Block-major host stack (the swap space's layout) <-> layer-major stack, both directions,
    with runs of consecutive host ids and lone ones, chunked and not."""
    device_side = _stacked_layers(gen, "cpu", 3, 24)
    whole = torch.randn((16, 3, 2, 16, 2, 64), generator=gen)
    host_side = list(whole.movedim(0, 2).unbind(0))
    assert stacked(host_side) is not None and stacked(device_side) is not None
    device_ids, host_ids = [3, 17, 4, 8, 22, 0], [5, 6, 7, 12, 0, 1]  # runs 5-7, 0-1 and a lone 12
    for cap in (1 << 30, 1):
        want = swap_blocks_ref(device_side, host_side, device_ids, host_ids)
        swap_blocks(device_side, host_side, device_ids, host_ids, max_staging_bytes=cap)
        assert all(torch.equal(h, w) for h, w in zip(host_side, want))
        back = [1, 2, 10, 11, 20, 23]
        want = swap_blocks_ref(host_side, device_side, host_ids, back)
        swap_blocks(host_side, device_side, host_ids, back, max_staging_bytes=cap)
        assert all(torch.equal(d, w) for d, w in zip(device_side, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_swap_moves_runs_between_a_gpu_stack_and_pinned_host_blocks(gen) -> None:
    """The contiguous-run branch, which only a copy across devices takes: a layer-major stack
    on the GPU <-> the block-major pinned host stack (the runner's swap space), runs of
    consecutive host ids (5-7, 0-1, 12-15) and lone ones, out and back in, chunked and not."""
    device_side = list(torch.randn((3, 2, 24, 16, 2, 64), generator=gen).to("cuda", torch.bfloat16).unbind(0))
    whole = torch.randn((16, 3, 2, 16, 2, 64), generator=gen).to(torch.bfloat16).pin_memory()
    host_side = list(whole.movedim(0, 2).unbind(0))
    assert stacked(host_side) is not None and stacked(device_side) is not None
    device_ids, host_ids = [3, 17, 4, 8, 22, 0, 9, 10, 11, 12], [5, 6, 7, 12, 0, 1, 13, 14, 15, 9]
    for cap in (1 << 30, 1):
        want = swap_blocks_ref(device_side, host_side, device_ids, host_ids)
        swap_blocks(device_side, host_side, device_ids, host_ids, max_staging_bytes=cap)
        assert all(torch.equal(h, w) for h, w in zip(host_side, want))
        back = [1, 2, 5, 6, 7, 23, 13, 14, 15, 16]
        want = swap_blocks_ref(host_side, device_side, host_ids, back)
        swap_blocks(host_side, device_side, host_ids, back, max_staging_bytes=cap)
        torch.cuda.synchronize()
        assert all(torch.equal(d, w.to(d.device)) for d, w in zip(device_side, want))
