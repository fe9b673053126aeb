#!/usr/bin/env python3
"""Speculative decoding side by side, in one process (a script, not a test): the same greedy
requests through ``conveyor.Engine`` without speculation, with the n-gram proposer, and with
the draft-model proposer (``--draft DIR``, and the model as its own draft: every proposal
accepted, the ceiling of what a draft can save in steps). Prints, per setting, the wall time,
output tokens per second, steps, and proposals accepted; checks that every setting's tokens
equal the plain run's.

    python bench/speculative_draft.py                       # the demo model, on CPU
    python bench/speculative_draft.py --model DIR --draft SMALL_DIR --device cuda

Runs back to back on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import time

from conveyor import Engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="demo", help="HF checkpoint directory or GGUF file (default: demo, the demo model)"
    )
    p.add_argument("--draft", action="append", default=[], help="a draft checkpoint to compare (repeatable)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()

    base = Engine(args.model, device=args.device, threads=args.threads)
    model_dir, vocab = base.model_dir, base.model_config.vocab_size
    del base
    k = args.num_speculative_tokens
    settings = {"off": {}, f"ngram k={k}": dict(speculative_method="ngram", num_speculative_tokens=k)}
    for draft in [*args.draft, model_dir]:
        name = "draft=self" if draft == model_dir else f"draft={draft}"
        settings[f"{name} k={k}"] = dict(
            speculative_method="draft", speculative_model=str(draft), num_speculative_tokens=k
        )
    prompts = [[(97 * i + 31 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)] for i in range(args.num_requests)]
    reference = None
    for name, config in settings.items():
        engine = Engine(model_dir, device=args.device, threads=args.threads, **config)
        engine.generate([prompts[0][:4]], max_tokens=4, temperature=0.0, ignore_eos=True, progress=False)  # warm-up
        before = engine.stats()
        start = time.perf_counter()
        requests = [
            engine.add_request(token_ids=p, max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            for p in prompts
        ]
        while engine.has_pending_requests():
            engine.step()
        wall = time.perf_counter() - start
        after = engine.stats()
        steps, proposed, accepted = (
            after[key] - before[key] for key in ("num_steps", "spec_proposed_tokens", "spec_accepted_tokens")
        )
        tokens = [r.tokens for r in requests]
        reference = reference or tokens
        same = "same tokens" if tokens == reference else "TOKENS DIFFER"
        total = args.num_requests * args.output_len
        print(
            f"{name:28s} {wall:7.2f} s {total / wall:8.1f} tok/s {steps:5d} steps  accepted {accepted}/{proposed}  "
            f"{same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
