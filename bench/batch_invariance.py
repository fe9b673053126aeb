#!/usr/bin/env python3
"""Batch-invariant mode on this device, checked bit for bit and timed on against off
(bench/gpu_checks' ``batch_invariance`` stage; docs/batch-invariance.md).

1. **Row rules.** The mode's matmul (:func:`conveyor.worker.models.layers.linear` with the
   mode's row tile: the Triton kernel on CUDA) and its row log-softmax at the checkpoint's
   shapes: row 0 the same bits at every row count of ``--rows``; the default matmul
   (``F.linear``: cuBLAS on CUDA) beside it, to show what the mode fixes here.
2. **Served.** One seeded request (sampling, its top-5 log-probabilities) served alone, then
   beside companions of random lengths at each batch size of ``--batches``, the steps cut at
   ``--step-tokens`` so its prefill is chunked differently each time: tokens and
   log-probabilities must be identical with the mode on; with it off the script says whether
   they moved (the check's teeth on this device).
3. **Cost.** The same workload (``--cost-batches`` requests of ``--prompt-len`` +
   ``--output-len`` tokens, greedy) on the two engines, alternated ``--repeats`` times: output
   tokens per second, on over off.

CUDA graphs stay on (the engines' default): the mode's kernels are captured like the others.

    python bench/batch_invariance.py --checkpoint CKPT --out batch_invariance.json         # CUDA, bf16
    python bench/batch_invariance.py --checkpoint CKPT --cpu --out batch_invariance.json   # the dry run

Exit 1 when the mode on lets a bit move.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--cpu", action="store_true", help="the dry run: the CPU path, float32, small sizes")
    p.add_argument("--rows", default="1,2,3,8,17,64,128,256")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--step-tokens", type=int, default=256, help="the engines' max_num_batched_tokens")
    p.add_argument("--target-prompt", type=int, default=300)
    p.add_argument("--target-tokens", type=int, default=24)
    p.add_argument("--cost-batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-memory", type=float, default=8.0, help="GiB per engine")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cpu:
        args.rows, args.batches, args.step_tokens, args.target_prompt, args.target_tokens = "1,2,3,17", "3", 16, 40, 4
        args.cost_batches, args.prompt_len, args.output_len, args.repeats, args.kv_cache_memory = "1,4", 8, 4, 1, 0.05
    return args


def row_rules(model, rows: list[int], device: str) -> dict:
    """Row 0's bits at each row count: the mode's matmul and log-softmax, and F.linear's."""
    import torch
    import torch.nn.functional as F

    from conveyor.kernels.layer_ops import softmax_rows
    from conveyor.worker.batch_invariant import ROW_TILE
    from conveyor.worker.models.layers import Linear, linear

    generator = torch.Generator(device="cpu").manual_seed(0)
    shapes = {tuple(m.weight.shape): m.weight for m in model.modules() if isinstance(m, Linear)}
    out: dict[str, object] = {"shapes": [list(s) for s in shapes], "mode": True, "default_moves": []}
    with torch.inference_mode():
        for shape, weight in shapes.items():
            x = torch.randn(max(rows), shape[1], generator=generator).to(device, weight.dtype)
            alone, default_alone = linear(x[:1], weight, None, None, ROW_TILE), F.linear(x[:1], weight)
            for count in rows:
                if not torch.equal(linear(x[:count], weight, None, None, ROW_TILE)[0], alone[0]):
                    out["mode"] = False
                    out.setdefault("mode_moves", []).append([list(shape), count])
                if not torch.equal(F.linear(x[:count], weight)[0], default_alone[0]):
                    out["default_moves"].append([list(shape), count])
        vocab = model.embed_tokens.weight.shape[0]
        logits = torch.randn(max(rows), vocab, generator=generator).to(device) * 4
        alone = softmax_rows(logits[:1], log=True, invariant=True)
        out["log_softmax"] = all(
            torch.equal(softmax_rows(logits[:count], log=True, invariant=True)[0], alone[0]) for count in rows
        )
    out["mode"] = out["mode"] and out["log_softmax"]
    return out


def serve_target(engine, target: list[int], tokens: int, companions: list[tuple[list[int], int]], before: int):
    """The target's tokens and per-token (logprob, top 5), served with ``companions``
    (``before`` of them queued first)."""
    handle = None
    for i, companion in enumerate([*companions, None]):
        if i == before:
            handle = engine.add_request(
                token_ids=target, max_tokens=tokens, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7, logprobs=5
            )
        if companion is not None:
            engine.add_request(token_ids=companion[0], max_tokens=companion[1], ignore_eos=True, temperature=0.0)
    while engine.has_pending_requests():
        engine.step()
    return handle.tokens, [(e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in handle.logprobs]


def timed(engine, batch: int, prompt_len: int, output_len: int, rng: random.Random, vocab: int) -> float:
    """Output tokens per second of ``batch`` greedy requests of fresh random prompts, run to the end."""
    import torch

    for _ in range(batch):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        engine.add_request(token_ids=prompt, max_tokens=output_len, ignore_eos=True, temperature=0.0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_pending_requests():
        engine.step()
    return batch * output_len / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "src"))
    import torch

    from conveyor import Engine

    args = parse_args(argv)
    device, dtype = ("cpu", "float32") if args.cpu else ("cuda", "bfloat16")
    common = dict(
        device=device,
        dtype=dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.step_tokens,
        max_num_seqs=max(int(b) for b in args.cost_batches.split(",")) + max(int(b) for b in args.batches.split(",")),
    )
    if args.cpu:
        common["threads"] = 1
    started = time.perf_counter()
    engines = {mode: Engine(args.checkpoint, **common, batch_invariant=mode == "on") for mode in ("off", "on")}
    result: dict[str, object] = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu", "dtype": dtype}
    result["startup_s"] = round(time.perf_counter() - started, 1)
    result["row_rules"] = row_rules(engines["on"].runner.model, [int(r) for r in args.rows.split(",")], device)

    rng = random.Random(0)
    vocab = min(1000, engines["on"].model_config.vocab_size)
    target = [rng.randrange(5, vocab) for _ in range(args.target_prompt)]
    served = {mode: [] for mode in engines}
    reference = {mode: serve_target(engine, target, args.target_tokens, [], 0) for mode, engine in engines.items()}
    for batch in (int(b) for b in args.batches.split(",")):
        companions = [
            ([rng.randrange(5, vocab) for _ in range(rng.randint(5, 2 * args.target_prompt))], rng.randint(1, 16))
            for _ in range(batch - 1)
        ]
        before = rng.randint(0, batch - 1)
        for mode, engine in engines.items():
            same = serve_target(engine, target, args.target_tokens, companions, before) == reference[mode]
            served[mode].append({"batch": batch, "same_bits": same})
    result["served"] = served
    invariant = all(r["same_bits"] for r in served["on"]) and result["row_rules"]["mode"]

    cost = []
    for batch in (int(b) for b in args.cost_batches.split(",")):
        for engine in engines.values():  # warm: compiles and first captures before the clock
            timed(engine, batch, args.prompt_len, 2, rng, vocab)
        runs = {mode: [] for mode in engines}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                runs[mode].append(timed(engine, batch, args.prompt_len, args.output_len, rng, vocab))
        best = {mode: max(values) for mode, values in runs.items()}
        cost.append(
            {"batch": batch, "tok_s": {m: [round(v, 1) for v in r] for m, r in runs.items()},
             "on_over_off": round(best["on"] / best["off"], 3)}
        )  # fmt: skip
    result["cost"] = cost
    result["invariant"] = invariant
    result["summary_line"] = (
        f"batch_invariance ({result['device']} {dtype}): bits held {invariant}; "
        + "; ".join(f"batch {r['batch']} on/off {r['on_over_off']}x" for r in cost)
        + "; mode off moved: "
        + ", ".join(f"batch {r['batch']} {not r['same_bits']}" for r in served["off"])
    )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(result["summary_line"])
    return 0 if invariant else 1


if __name__ == "__main__":
    sys.exit(main())
