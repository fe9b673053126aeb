#!/usr/bin/env python3
"""CPU matmul of the quantized methods against float32, on SmolLM2-135M's shapes (a script).

For each ``[in, out]`` projection shape of SmolLM2 (576x576 q/o, 576x1536 gate/up, 1536x576
down, 576x49152 the LM head) and rows ``M`` of 1, 8 and 32 it times, interleaved in one
loop, the float32 product the model serves (oneDNN on a packed weight,
:func:`conveyor.worker.models.layers.linear`) and each :mod:`conveyor.worker.quantization.methods`
``apply`` on the same weight quantized, and prints each method's speed-up (float32 time /
its time; best of ``--rounds`` rounds of ``--iters`` calls, so a busy shared machine biases
both sides alike). It also times the candidates that were not chosen (docs/quantization.md):
``_weight_int8pack_mm`` (int8 weight-only, bfloat16 activations).

    python bench/quant_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from conveyor.worker.models.layers import linear, pack_cpu_weight
from conveyor.worker.quantization.methods import Fp8Weights, Int4Weights, Int8Weights
from conveyor.worker.quantization.tensors import quantize_int4, quantize_int8

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152)]


def best_time(fn, iters: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; speed-up = float32 time / method time (>1: faster)")
    print(f"{'in x out':>12} {'M':>3} {'f32 us':>9} {'int8':>6} {'int4':>6} {'fp8':>6} {'i8pack':>7}")
    for k, n in SHAPES:
        weight = torch.randn(n, k, generator=gen) * 0.05
        packed = pack_cpu_weight(weight)
        int8, int4 = Int8Weights(quantize_int8(weight), "cpu"), Int4Weights(quantize_int4(weight, 32), "cpu")
        fp8 = Fp8Weights.quantize(weight, "cpu")
        q8 = quantize_int8(weight)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            xb, s8 = x.bfloat16(), q8.scales.reshape(-1).bfloat16()
            candidates = {
                "f32": lambda: linear(x, weight, None, packed),
                "int8": lambda: int8.apply(x, None),
                "int4": lambda: int4.apply(x, None),
                "fp8": lambda: fp8.apply(x, None),
                "i8pack": lambda: torch.ops.aten._weight_int8pack_mm(xb, q8.codes, s8).float(),
            }
            times = {name: float("inf") for name in candidates}
            for _ in range(args.rounds):  # interleaved: each round times every candidate once
                for name, fn in candidates.items():
                    times[name] = min(times[name], best_time(fn, args.iters, 1))
            f32 = times["f32"]
            ratios = " ".join(f"{f32 / times[name]:>6.2f}" for name in ("int8", "int4", "fp8"))
            print(f"{k:>5}x{n:<6} {m:>3} {f32 * 1e6:>9.1f} {ratios} {f32 / times['i8pack']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
