"""The static per-layer scales of an 8-bit KV cache, measured once at start.

The model prefills one sequence of seeded random token ids into a small cache in its own
dtype; each layer's scales are the largest key and value magnitudes it stored, times a
headroom, over the 8-bit dtype's range (:func:`~conveyor.worker.attention.kv_quant.scales_for`).
Random ids rather than text: the worker holds no tokenizer, and a layer's key and value
magnitudes come from its weights and norms far more than from which tokens run (measured on
SmolLM2: real chats reached at most 1.4x the keys' and 1.8x the values' per-layer maxima of
256 random ids, hence the headroom). Why static and per layer: docs/architecture.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from conveyor.worker.attention.backend import AttentionMetadata
from conveyor.worker.attention.kv_quant import FP8, KVScales, quantized, scales_for
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.models.interface import CausalLM

#: Tokens of the calibration prefill (fewer when the model's context is shorter).
CALIBRATION_TOKENS = 256
#: Multiples of the calibrated maxima each dtype still stores unclipped. fp8 keeps its
#: relative precision across its range, so room costs it nothing; int8's step grows with its
#: scale, so it gets just over the largest excess measured (1.8x).
HEADROOM = {FP8: 4.0, torch.int8: 2.0}
SEED = 0x5CA1E


@torch.inference_mode()
def calibrate_kv_scales(model: CausalLM, shape: KVCacheShape, cache_dtype: torch.dtype) -> list[KVScales] | None:
    """Per-layer scales for a cache of ``cache_dtype`` (None when it is not 8-bit, which needs
    none) from a calibration prefill of ``model`` into a cache shaped like ``shape`` in the
    model's dtype; the model is left bound to that cache (bind the real one after). Under
    tensor parallelism every rank calls this at once (the forward's collectives) and the ranks
    share their maxima, so a layer has the scales it has unsplit."""
    if not quantized(cache_dtype):
        return None
    config, device = model.config, model.device
    num_tokens = min(CALIBRATION_TOKENS, config.max_position_embeddings)
    num_blocks = -(-num_tokens // shape.block_size)
    caches = KVCacheShape(shape.num_layers, shape.block_size, shape.num_kv_heads, shape.head_dim, model.dtype).allocate(
        num_blocks, device
    )
    model.bind_kv_cache(caches)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(config.vocab_size, (num_tokens,), generator=generator).to(device)
    positions = torch.arange(num_tokens, device=device)
    metadata = AttentionMetadata.build([num_tokens], [0], [list(range(num_blocks))], shape.block_size, device)
    model(tokens, positions, metadata)
    # The cache's unwritten slots are zeros: they never raise a maximum.
    amax = torch.stack([cache.abs().amax(dim=(1, 2, 3, 4)).float() for cache in caches])
    tp = model.tensor_parallel
    if tp.size > 1:  # the layer's maxima over every rank's heads: one scale per layer, as unsplit
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    return [scales_for(k, v, cache_dtype, HEADROOM[cache_dtype]) for k, v in amax.tolist()]
