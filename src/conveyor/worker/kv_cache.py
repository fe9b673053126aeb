"""The paged KV cache tensors: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer.

The scheduler owns which block belongs to whom; these tensors only hold the data. Blocks
are zero-filled at allocation so a backend that reads a whole block never sees garbage
(NaN/inf bit patterns) in the slots a sequence has not written yet. On the CPU the zeros are
the kernel's (:func:`zeroed`): pages are zero-filled when first touched, so a start does not
write the whole pool (1 GiB by default: half a CPU second and its memory, at every start).

Under tensor parallelism ``num_kv_heads`` is the rank's own (:func:`~conveyor.worker.parallel.
shard_heads`): each rank caches only the heads it computes, so sizes here are per rank.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from dataclasses import dataclass

import torch

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.runtime.model_source import StartupError
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel, shard_heads


class KVCacheTooSmall(StartupError, ValueError):
    """The KV-cache memory asked for holds no block: a setting to change, said in one line
    (a StartupError to bin/serve, a ValueError to the engine's callers)."""


@dataclass(frozen=True)
class KVCacheShape:
    """One rank's cache geometry, which every cache and swap tensor here is shaped by: a
    layer's ``num_blocks`` blocks are ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    of ``dtype``. Built once (:meth:`of`) from the model and the rank, so the sizing and
    both allocations agree on the rank's share of the kv heads."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(
        cls,
        model_config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> KVCacheShape:
        """The shape on rank ``tensor_parallel.rank``: only the kv heads that rank computes."""
        heads = shard_heads(model_config.num_heads, model_config.num_kv_heads, tensor_parallel)
        return cls(model_config.num_layers, block_size, heads.num_kv_heads, model_config.head_dim, dtype)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache (or swap space) shape."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs across all layers (keys and values of the rank's kv heads)."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * math.prod(self.layer_shape(1)) * element_size

    def allocate(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer, indexed by layer: contiguous views of one
        ``[layers, 2, num_blocks, ...]`` allocation, so block copies can move a block of every
        layer in one op (:func:`conveyor.kernels.block_copy.stacked`)."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        whole = zeroed((self.num_layers, *self.layer_shape(num_blocks)), self.dtype, device)
        return list(whole.unbind(0))

    def allocate_swap(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """The CPU swap space for a cache on ``device``: per layer, ``num_blocks`` blocks shaped
        like the cache's.

        Pinned (page-locked) when the cache is on a CUDA device, so the copies between the two
        run at full bus bandwidth; plain memory otherwise (a CPU worker "swaps" within RAM).
        Empty (zero blocks) when swapping is off.

        Block-major: the layers are views of one ``[num_blocks, layers, 2, ...]`` allocation, so
        a block of every layer is one contiguous range, and a run of consecutive blocks too: a
        swap moves each run in one copy (:func:`conveyor.kernels.block_copy.swap_blocks`).
        """
        halves, blocks, *block = self.layer_shape(num_blocks)
        shape = (blocks, self.num_layers, halves, *block)
        if torch.device(device).type == "cuda":
            whole = torch.zeros(shape, dtype=self.dtype, pin_memory=True)
        else:
            whole = zeroed(shape, self.dtype, "cpu")
        return list(whole.movedim(0, 2).unbind(0))  # layer i: [2, num_blocks, ...], strided


# Below this many bytes a tensor is zeroed by writing it: the pages given back would be few.
_LAZY_ZEROS_MIN_BYTES = 1 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``, whose large CPU tensors cost no start-up time: the storage is
    torch's own (resizable, as sleep needs), its whole pages handed back to the kernel
    (``madvise(MADV_DONTNEED)``, after which private anonymous memory reads as zeros and is
    committed when first written) and only the partial pages at its ends written. Elsewhere
    (another device or OS, a small tensor, a refused madvise) the tensor is written with zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype)
    raw = tensor.view(-1).view(torch.uint8)
    start, end = tensor.data_ptr(), tensor.data_ptr() + raw.numel()
    first_page = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last_page = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last_page - first_page < _LAZY_ZEROS_MIN_BYTES or not _pages_dropped(first_page, last_page - first_page):
        return tensor.zero_()
    raw[: first_page - start].zero_()
    raw[last_page - start :].zero_()
    return tensor


def _pages_dropped(address: int, length: int) -> bool:
    """Whether the kernel dropped the pages of ``[address, address + length)`` (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(address, length, mmap.MADV_DONTNEED) == 0
