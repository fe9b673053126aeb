"""The 8-bit KV cache's rule: which dtype holds it, the per-layer scales, and how a key or
value becomes its stored byte and back (``--kv-cache-dtype fp8|int8``).

A layer's keys share one float32 scale and its values another, fixed at start
(:mod:`conveyor.worker.kv_calibration`): stored ``q = quantize(x / scale)``, read
``x ~ q * scale``. Static scales keep the pool's blocks pure data, so an 8-bit block is half a
16-bit one exactly and block copies, swaps and prefix sharing move bytes as before. Why
static and per layer: docs/architecture.md, "KV cache in 8 bits". The Triton kernels apply
the same rule (:func:`conveyor.kernels._common.quantize_kv`); this is its torch form, used by
the torch backends and as the kernels' reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FP8 = torch.float8_e4m3fn
#: Largest magnitudes each 8-bit dtype stores: e4m3fn's finite maximum, int8's symmetric range.
QMAX = {FP8: 448.0, torch.int8: 127.0}
#: The 8-bit cache dtypes by their ``--kv-cache-dtype`` name.
CACHE_DTYPES = {"fp8": FP8, "int8": torch.int8}


def quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds scaled 8-bit values (else it holds the values as they are)."""
    return dtype in QMAX


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a ``--kv-cache-dtype`` name: ``auto`` is the model's."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return CACHE_DTYPES[kv_cache_dtype]


def _f32(value: float) -> float:
    return float(np.float32(value))


@dataclass(frozen=True)
class KVScales:
    """One layer's scales: stored keys are ``key / k``, values ``value / v`` (1 and 1 for a
    float cache). Held as float32 values, and so are their reciprocals, which the stores
    multiply by (the kernels too: the same float32 product on every device)."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        if not (self.k > 0 and self.v > 0 and np.isfinite(self.k) and np.isfinite(self.v)):
            raise ValueError(f"KV scales must be positive and finite, got k={self.k}, v={self.v}")
        object.__setattr__(self, "k", _f32(self.k))
        object.__setattr__(self, "v", _f32(self.v))

    @property
    def inv_k(self) -> float:
        return _f32(np.float32(1.0) / np.float32(self.k))

    @property
    def inv_v(self) -> float:
        return _f32(np.float32(1.0) / np.float32(self.v))


UNIT_SCALES = KVScales()


def to_cache(x: torch.Tensor, inv_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: cast as it is for a float cache; else
    ``x * inv_scale`` in float32, clamped to the dtype's range, rounded to nearest (ties to
    even: int8 by ``round``, fp8 by the cast) and cast."""
    if not quantized(dtype):
        return x.to(dtype)
    scaled = (x.float() * inv_scale).clamp_(-QMAX[dtype], QMAX[dtype])
    if dtype == torch.int8:
        scaled = scaled.round_()
    return scaled.to(dtype)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of cache entries ``stored``: ``stored * scale`` (by definition)."""
    out = stored.float()
    return out.mul_(scale) if scale != 1.0 else out


def scales_for(amax_k: float, amax_v: float, dtype: torch.dtype, headroom: float) -> KVScales:
    """Scales under which ``headroom`` times the largest magnitudes seen (``amax_k``,
    ``amax_v``) still fit ``dtype``'s range; 1 where nothing nonzero was seen."""
    qmax = QMAX[dtype]

    def scale(amax: float) -> float:
        return amax * headroom / qmax if amax > 0 and np.isfinite(amax) else 1.0

    return KVScales(scale(amax_k), scale(amax_v))
