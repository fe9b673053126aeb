"""The paged KV cache tensors: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer.

The scheduler owns which block belongs to whom; these tensors only hold the data. Blocks
are zero-filled at allocation so a backend that reads a whole block never sees garbage
(NaN/inf bit patterns) in the slots a sequence has not written yet.
"""

from __future__ import annotations

import torch

from conveyor.checkpoints.model_config import ModelConfig


def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Device bytes one block costs across all layers (keys and values)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * element_size


def allocate_kv_cache(
    model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, indexed by layer."""
    if num_blocks < 1:
        raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
    shape = (2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)]


def allocate_swap_space(
    model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """The CPU swap space: per layer, ``num_blocks`` blocks shaped like the GPU cache's.

    Pinned (page-locked) when the cache is on a CUDA device, so the copies between the two
    run at full bus bandwidth; plain memory otherwise (a CPU worker "swaps" within RAM).
    Empty (zero blocks) when swapping is off.
    """
    shape = (2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    pin = torch.device(device).type == "cuda"
    return [torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin) for _ in range(model_config.num_layers)]
