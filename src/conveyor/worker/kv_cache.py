"""The paged KV cache tensors: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer.

The scheduler owns which block belongs to whom; these tensors only hold the data. Blocks
are zero-filled at allocation so a backend that reads a whole block never sees garbage
(NaN/inf bit patterns) in the slots a sequence has not written yet.

Under tensor parallelism ``num_kv_heads`` is the rank's own (:func:`~conveyor.worker.parallel.
shard_heads`): each rank caches only the heads it computes, so sizes here are per rank.
"""

from __future__ import annotations

import math

import torch

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker.parallel import NO_TENSOR_PARALLEL, TensorParallel, shard_heads


def _block_shape(model_config: ModelConfig, num_blocks: int, block_size: int, tp: TensorParallel) -> tuple[int, ...]:
    """One layer's cache (or swap space) shape on rank ``tp.rank``."""
    num_kv_heads = shard_heads(model_config.num_heads, model_config.num_kv_heads, tp).num_kv_heads
    return (2, num_blocks, block_size, num_kv_heads, model_config.head_dim)


def bytes_per_block(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
) -> int:
    """Device bytes one block costs across all layers (keys and values of the rank's kv heads)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    one_block = math.prod(_block_shape(model_config, 1, block_size, tensor_parallel))
    return model_config.num_layers * one_block * element_size


def allocate_kv_cache(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, indexed by layer: contiguous views of one
    ``[layers, 2, num_blocks, ...]`` allocation, so block copies can move a block of every
    layer in one op (:func:`conveyor.kernels.block_copy.stacked`)."""
    if num_blocks < 1:
        raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
    shape = _block_shape(model_config, num_blocks, block_size, tensor_parallel)
    return list(torch.zeros((model_config.num_layers, *shape), dtype=dtype, device=device).unbind(0))


def allocate_swap_space(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tensor_parallel: TensorParallel = NO_TENSOR_PARALLEL,
) -> list[torch.Tensor]:
    """The CPU swap space: per layer, ``num_blocks`` blocks shaped like the GPU cache's.

    Pinned (page-locked) when the cache is on a CUDA device, so the copies between the two
    run at full bus bandwidth; plain memory otherwise (a CPU worker "swaps" within RAM).
    Empty (zero blocks) when swapping is off.

    Block-major: the layers are views of one ``[num_blocks, layers, 2, ...]`` allocation, so
    a block of every layer is one contiguous range, and a run of consecutive blocks too: a
    swap moves each run in one copy (:func:`conveyor.kernels.block_copy.swap_blocks`).
    """
    halves, blocks, *block = _block_shape(model_config, num_blocks, block_size, tensor_parallel)
    pin = torch.device(device).type == "cuda"
    whole = torch.zeros((blocks, model_config.num_layers, halves, *block), dtype=dtype, device="cpu", pin_memory=pin)
    return list(whole.movedim(0, 2).unbind(0))  # layer i: [2, num_blocks, ...], strided
