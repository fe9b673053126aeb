#!/usr/bin/env python3
"""Decode speed of SmolLM2 in float32, int8, int4 and its own Q4_1 kept quantized, interleaved
(a script, not a test): one ``conveyor.Engine`` per system in this process, each round runs
every system once at each batch size (``batch`` prompts, greedy, ``--tokens`` new tokens each,
``ignore_eos``), and the table gives each system's output tok/s (median over rounds) and its
ratio to float32 measured in the same rounds. Prefill is included, as in bin/bench.

    python bench/quant_decode.py --float /path/smollm2-hf --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from conveyor import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--float", required=True, help="the float32 checkpoint (f32, int8, int4 load it)")
    parser.add_argument("--gguf", required=True, help="the Q4_1 file (served with --quantization gguf)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    systems = {"f32": (args.float, "none"), "int8": (args.float, "int8"), "int4": (args.float, "int4")}
    systems["gguf"] = (args.gguf, "gguf")
    engines = {
        name: Engine(model, device="cpu", threads=args.threads, num_kv_blocks=512, max_batch_size=32, quantization=q)
        for name, (model, q) in systems.items()
    }
    prompt = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    rates: dict[tuple[str, int], list[float]] = {}
    loads = []
    for _ in range(args.rounds):
        for batch in map(int, args.batches.split(",")):
            for name, engine in engines.items():
                start = time.perf_counter()
                out = engine.generate(
                    [prompt] * batch, max_tokens=args.tokens, temperature=0.0, ignore_eos=True, progress=False
                )
                elapsed = time.perf_counter() - start
                rates.setdefault((name, batch), []).append(sum(len(r.token_ids) for r in out) / elapsed)
        loads.append(os.getloadavg()[0])
    for engine in engines.values():
        engine.close()
    rows = []
    print(
        f"threads {args.threads}, {args.rounds} rounds, load average during the run {min(loads):.1f}-{max(loads):.1f}"
    )
    print(f"{'system':>6} {'batch':>5} {'tok/s':>8} {'x f32':>6}  (ratio: median of per-round ratios)")
    for (name, batch), values in rates.items():
        ratios = [v / f for v, f in zip(values, rates[("f32", batch)])]
        row = {"system": name, "batch": batch, "tok_s": statistics.median(values), "ratio": statistics.median(ratios)}
        rows.append(row)
        print(f"{name:>6} {batch:>5} {row['tok_s']:>8.1f} {row['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "loads": loads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
