#!/usr/bin/env python3
"""Host cost of one kernel launch wrapper call, measured without a GPU (a script, not a test).

On a GPU a small kernel (one decode token's ``kv_store``, a batch-1 decode) finishes in a few
microseconds, so the call costs what the host spends getting it launched: the wrapper's checks,
tile planning and scratch allocation, then Triton's ``JITFunction.run`` (binding and
specializing every argument, the compiled-kernel cache lookup, the driver launch). This script
times the first two parts on the CPU with CPU tensors of the 1B config's shapes, by replacing
``JITFunction.run`` with a stand-in:

- ``wrapper``: returns at once, so what is timed is our Python alone;
- ``wrapper+bind``: also runs Triton's argument binder (the function Triton generates per
  kernel that specializes each argument: dtypes, 16-byte alignment, integer divisibility) and
  builds the cache key, as a real launch does before looking the kernel up.

The driver's launch itself needs a GPU and is not in these figures. Times are per call, the
fastest and the median of ``--rounds`` rounds of ``--calls`` calls; a machine shared with other
work moves the medians, compare runs made back to back.

    python bench/launch_host.py
    python bench/launch_host.py --label after --out bench/results/launch-host-cpu.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from harness import per_call_us  # bench/ is this script's directory
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 64, 2048, 8192
BLOCK_SIZE, NUM_BLOCKS, CONTEXT = 16, 1024, 512
DTYPE = torch.bfloat16


class StubLaunch:
    """Stands in for ``JITFunction.run``; with :attr:`bind` it runs Triton's binder and key."""

    def __init__(self) -> None:
        self.bind = False
        self._backend = make_backend(GPUTarget("cuda", 90, 32))
        self._binders: dict[int, Callable[..., Any]] = {}

    def __call__(self, fn: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if self.bind:
            binder = self._binders.get(id(fn))
            if binder is None:
                binder = self._binders[id(fn)] = create_function_from_signature(fn.signature, fn.params, self._backend)
            kwargs["debug"] = False
            _, specialization, options = binder(*args, **kwargs)
            compute_cache_key({}, specialization, options)


def calls(batch: int) -> dict[str, Callable[[], Any]]:
    """name -> a zero-argument call of that wrapper at decode shapes for ``batch`` sequences;
    wrappers missing from the code under test (an older tree) are left out."""
    qkv = torch.empty(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=DTYPE)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = q.view(batch, HEADS, HEAD_DIM), k.view(batch, KV_HEADS, HEAD_DIM), v.view(batch, KV_HEADS, HEAD_DIM)
    kv = torch.empty(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE)
    slots = torch.arange(batch, dtype=torch.int64)
    positions = torch.full((batch,), CONTEXT - 1, dtype=torch.int64)
    tables = torch.zeros(batch, CONTEXT // BLOCK_SIZE, dtype=torch.int32)
    seq_lens = torch.full((batch,), CONTEXT, dtype=torch.int32)
    cos_sin = torch.empty(4096, HEAD_DIM, dtype=torch.float32)
    x, residual = torch.empty(batch, HIDDEN, dtype=DTYPE), torch.empty(batch, HIDDEN, dtype=DTYPE)
    weight = torch.empty(HIDDEN, dtype=DTYPE)
    gate_up = torch.empty(batch, 2 * INTERMEDIATE, dtype=DTYPE)
    wanted: dict[str, tuple[str, str, Callable[[Callable[..., Any]], Callable[[], Any]]]] = {
        "kv_store": ("kv_store", "kv_store", lambda f: lambda: f(k, v, kv, slots)),
        "paged_decode": (
            "paged_decode",
            "paged_decode_attention",
            lambda f: lambda: f(q, kv, tables, seq_lens, HEAD_DIM**-0.5, None, max_seq_len=CONTEXT),
        ),
        "rope_kv_store": (
            "rope_kv_store",
            "rope_kv_store",
            lambda f: lambda: f(q, k, v, positions, cos_sin, kv, slots),
        ),
        "add_rms_norm": ("rms_norm", "add_rms_norm_triton", lambda f: lambda: f(x, residual, weight, 1e-5)),
        "silu_mul": ("silu_mul", "silu_mul_triton", lambda f: lambda: f(gate_up)),
    }
    out = {}
    for name, (module, function, bind) in wanted.items():
        try:
            out[name] = bind(getattr(importlib.import_module(f"conveyor.kernels.{module}"), function))
        except (ImportError, AttributeError):
            continue
    return out


def time_call(call: Callable[[], Any], calls_per_round: int, rounds: int) -> dict[str, float]:
    """Fastest and median round's us per call, after one untimed round."""
    per_call = per_call_us(call, calls_per_round, rounds, warmup_calls=calls_per_round)
    return {"min_us": min(per_call), "median_us": statistics.median(per_call)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 128])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--label", default="current", help="key of this run's figures in --out")
    p.add_argument("--out", type=Path, help="JSON file to merge this run's figures into")
    args = p.parse_args()
    torch.set_num_threads(1)
    stub = StubLaunch()
    JITFunction.run = lambda fn, *a, grid, warmup, **kw: stub(fn, *a, grid=grid, warmup=warmup, **kw)
    results: dict[str, Any] = {}
    print(f"{'call':16s} {'batch':>5s} {'wrapper us (min/median)':>24s} {'wrapper+bind us':>18s}")
    for batch in args.batches:
        for name, call in calls(batch).items():
            row = {}
            for bind in (False, True):
                stub.bind = bind
                row["wrapper+bind" if bind else "wrapper"] = time_call(call, args.calls, args.rounds)
            results[f"{name} batch {batch}"] = row
            w, b = row["wrapper"], row["wrapper+bind"]
            print(
                f"{name:16s} {batch:5d} {w['min_us']:11.1f} / {w['median_us']:6.1f}   "
                f"{b['min_us']:8.1f} / {b['median_us']:6.1f}"
            )
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged[args.label] = {
            "shapes": {
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "hidden": HIDDEN,
                "intermediate": INTERMEDIATE,
                "context": CONTEXT,
                "dtype": str(DTYPE),
            },
            "versions": {
                "torch": torch.__version__,
                "triton": triton.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(),
            },
            "results": results,
        }
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
