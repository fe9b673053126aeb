#!/usr/bin/env python3
"""The fused MoE layer against the dense MLP of equal active parameters (bench/gpu_checks' ``moe``
stage; docs/benchmarks.md, "What the GPU owes").

A token of a MoE layer with ``E`` experts of width ``I``, ``k`` per token, multiplies by ``3 k I H``
weights, as a token of a dense gated MLP of width ``k I`` does; the MoE layer also routes (a
``[E, H]`` projection, softmax, top-k), sorts the pairs by expert and, at a small batch, reads
more weights (each active expert's whole matrices). The target (issue 40): the MoE layer within
1.3x of that dense MLP at batch 64, on the GPU, Qwen3-30B-A3B's shapes (H 2048, I 768, E 128,
k 8). Both are timed call by call, interleaved, with CUDA events (the median reported); ``--cpu``
is the dry run's: tiny shapes, the CPU path (sorted groups, torch matmuls), wall-clock timers.

    python bench/moe_layer.py --out moe.json              # CUDA, bf16, batches 1, 64, 512
    python bench/moe_layer.py --cpu --out moe.json        # the dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.3  # MoE over dense at batch 64
TARGET_BATCH = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the dry run: tiny shapes on the CPU")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batches", default="1,64,512")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cpu:
        args.dtype, args.hidden, args.width, args.experts, args.top_k = "float32", 64, 32, 8, 2
        args.batches, args.iters = "1,8", 3
    return args


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "src"))
    import torch
    import torch.nn.functional as F

    from conveyor.kernels.layer_ops import moe_experts, silu_and_mul
    from conveyor.worker.models.moe import route

    args = parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    h, i, e, k = args.hidden, args.width, args.experts, args.top_k

    def weights(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) / shape[-1] ** 0.5).to(dtype)

    router, w13, w2 = weights(e, h), weights(e, 2 * i, h), weights(e, h, i)
    dense_gate_up, dense_down = weights(2 * k * i, h), weights(h, k * i)

    def moe(x: torch.Tensor) -> torch.Tensor:
        top, ids = route(F.linear(x, router), k, True)
        return moe_experts(x, w13, w2, top, ids)

    def dense(x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, dense_gate_up)), dense_down)

    def timed(fn, x) -> float:
        """Microseconds of one call."""
        if args.cpu:
            start = time.perf_counter()
            fn(x)
            return (time.perf_counter() - start) * 1e6
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(x)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3

    rows = []
    with torch.inference_mode():
        for batch in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(batch, h, generator=gen, device=device).to(dtype)
            for fn in (moe, dense, moe, dense):  # warm-up: compiles and allocations
                fn(x)
            samples = {"moe": [], "dense": []}
            for _ in range(args.iters):  # interleaved, so both see the same clocks and neighbours
                samples["moe"].append(timed(moe, x))
                samples["dense"].append(timed(dense, x))
            moe_us, dense_us = statistics.median(samples["moe"]), statistics.median(samples["dense"])
            rows.append({"batch": batch, "moe_us": round(moe_us, 2), "dense_us": round(dense_us, 2),
                         "moe_over_dense": round(moe_us / dense_us, 3)})  # fmt: skip
    at_target = next((r for r in rows if r["batch"] == TARGET_BATCH), None)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": args.dtype,
        "shape": {"hidden": h, "width": i, "experts": e, "top_k": k},
        "rows": rows,
        "target": {"batch": TARGET_BATCH, "moe_over_dense_at_most": TARGET,
                   "met": None if at_target is None else at_target["moe_over_dense"] <= TARGET},
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"batch {r['batch']:>4}: moe {r['moe_us']:.1f} us, dense {r['dense_us']:.1f} us, {r['moe_over_dense']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
