#!/usr/bin/env python3
"""Greedy agreement of a quantized checkpoint served kept quantized against its dequantized
float32 (a script, not a test): bin/eval's 100 items (``conveyor_tools.eval.tasks``), greedy,
24 tokens, through ``conveyor.Engine`` with ``--quantization none`` and then ``--quantization``
(``gguf`` by default: the file kept quantized); prints
how many items' tokens are equal and each run's accuracy.

    python bench/quant_agreement.py --model SmolLM2-135M-Instruct.Q4_1.gguf --json agreement.json

(In-process rather than through bin/eval's server: on an overloaded machine a 100-prompt
prefill step can outlast the server's --hang-timeout, which fails the requests.)
"""

from __future__ import annotations

import argparse
import json

from conveyor import Engine
from conveyor_tools.eval.tasks import tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantization", default="gguf", help="the scheme compared with none (float32)")
    parser.add_argument("--json")
    args = parser.parse_args()
    items = tasks()
    runs = {}
    for scheme in ("none", args.quantization):
        with Engine(
            args.model, device="cpu", threads=args.threads, num_kv_blocks=512, max_batch_size=32, quantization=scheme
        ) as engine:
            results = engine.generate(
                [i.messages() for i in items], max_tokens=args.max_tokens, temperature=0.0, progress=False
            )
        runs[scheme] = [
            {"id": i.id, "tokens": list(r.token_ids), "reply": r.text, "correct": i.correct(r.text)}
            for i, r in zip(items, results)
        ]
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(runs["none"], runs[args.quantization]))
    correct = {scheme: sum(row["correct"] for row in rows) for scheme, rows in runs.items()}
    print(
        f"{same}/{len(items)} items with equal tokens; "
        f"correct: float32 {correct['none']}, {args.quantization} {correct[args.quantization]}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"equal_tokens": same, "items": len(items), "correct": correct, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
