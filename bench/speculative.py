#!/usr/bin/env python3
"""Speculative decoding (n-gram proposals) against plain greedy decoding (a script, not a test).

In-process engines (``conveyor.Engine``) on one checkpoint, greedy requests with prompts that
repeat a phrase (so the n-gram proposer finds proposals), run to completion three ways in the
same process, each after a short warm-up on its own engine:

- ``plain``: no speculation, every decode step through the static buffers (graphs on CUDA);
- ``spec_ragged``: speculation with its verify steps on the ragged (prefill-like) path, as
  before the static verify step (the runner given no verify width);
- ``spec_static``: speculation with its verify steps through the static buffers (a graph per
  bucket and width on CUDA; worker/decode_step.py).

Per system: output tokens per second, this process's CPU seconds (on a shared CPU machine the
steadier figure), steps, proposals accepted, and how many steps ran the static path with
proposals. The JSON has bench/gpu_checks.py's shape (``settings``,
``systems.<name>.median.output_tok_s``), so its summary prints the figures.

    python bench/speculative.py --smoke                       # the demo model on CPU: seconds
    python bench/speculative.py --checkpoint DIR --device cuda --dtype bfloat16 --out spec.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import replace
from pathlib import Path

import conveyor.engine.engine as engine_module
from conveyor import Engine
from conveyor.checkpoints.model_config import ModelConfig
from conveyor.runtime.model_source import resolve_model


def repetitive(i: int, length: int, vocab: int) -> list[int]:
    """``length`` token ids repeating a phrase of its own (distinct per ``i``)."""
    phrase = [(97 * i + 31 * j) % (vocab - 10) + 5 for j in range(5 + i % 7)]
    return (phrase * (length // len(phrase) + 1))[:length]


def run(system: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    config = dict(
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_batch_size=args.requests,
        threads=args.threads,
    )
    if system != "plain":
        config.update(speculative_method="ngram", num_speculative_tokens=args.k)
    build = engine_module.build_runner
    if system == "spec_ragged":  # a runner without a verify width sends proposals down the ragged path
        engine_module.build_runner = lambda config, **kw: build(replace(config, num_speculative_tokens=0), **kw)
    try:
        engine = Engine(args.checkpoint, **config)
    finally:
        engine_module.build_runner = build
    runner, verify_steps = engine.runner, [0]
    run_decode = runner.decode.run

    def counting(rows, q):
        verify_steps[0] += q > 1
        return run_decode(rows, q)

    runner.decode.run = counting
    greedy = dict(temperature=0.0, ignore_eos=True)
    engine.add_request(token_ids=prompts[0][:32], request_id="warm-up", max_tokens=8, **greedy)
    while engine.has_pending_requests():
        engine.step()
    before, verify_steps[0] = engine.stats(), 0
    requests = [
        engine.add_request(token_ids=p, request_id=f"r{i}", max_tokens=args.max_tokens, **greedy)
        for i, p in enumerate(prompts)
    ]
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_pending_requests():
        engine.step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    stats = engine.stats()
    tokens = sum(len(r.tokens) for r in requests)
    delta = {
        key: stats.get(key, 0) - before.get(key, 0)
        for key in ("num_steps", "spec_proposed_tokens", "spec_accepted_tokens")
    }
    return {
        "median": {"output_tok_s": tokens / seconds},
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "output_tokens": tokens,
        "static_verify_steps": verify_steps[0],
        **delta,
        "outputs": [r.tokens for r in requests],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="demo", help="model directory or GGUF file (default: demo, the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=8, help="requests, all in one batch")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="4 requests, 48-token prompts, 12 tokens")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.smoke:
        args.requests, args.prompt_len, args.max_tokens, args.kv_cache_memory = 4, 48, 12, 0.05
    vocab = ModelConfig.from_dir(resolve_model(args.checkpoint)[0]).vocab_size
    prompts = [repetitive(i, args.prompt_len, vocab) for i in range(args.requests)]
    systems = {}
    for name in ("plain", "spec_ragged", "spec_static"):
        systems[name] = run(name, args, prompts)
        gc.collect()  # the engine's KV pool and graphs go before the next engine's are sized

    outputs = {name: result.pop("outputs") for name, result in systems.items()}
    result = {
        "settings": {
            "batch_size": args.requests,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "k": args.k,
            "device": args.device,
            "dtype": args.dtype,
            "checkpoint": args.checkpoint,
        },
        "systems": systems,
        "outputs_equal": outputs["spec_static"] == outputs["spec_ragged"],
        "outputs_equal_plain": outputs["spec_static"] == outputs["plain"],
        "static_over_ragged": systems["spec_static"]["median"]["output_tok_s"]
        / systems["spec_ragged"]["median"]["output_tok_s"],
        "static_over_plain": systems["spec_static"]["median"]["output_tok_s"]
        / systems["plain"]["median"]["output_tok_s"],
    }
    for name, r in systems.items():
        print(
            f"{name:<12} {r['median']['output_tok_s']:>10,.0f} out tok/s  cpu {r['cpu_seconds']:.2f} s  "
            f"{r['num_steps']:>5} steps  "
            f"accepted {r['spec_accepted_tokens']}/{r['spec_proposed_tokens']}  static verify steps "
            f"{r['static_verify_steps']}"
        )
    print(
        f"spec_static / spec_ragged {result['static_over_ragged']:.2f}x, spec_static / plain "
        f"{result['static_over_plain']:.2f}x, outputs equal (static vs ragged) {result['outputs_equal']}, "
        f"(static vs plain) {result['outputs_equal_plain']}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if systems["spec_static"]["static_verify_steps"] == 0 or systems["spec_ragged"]["static_verify_steps"] != 0:
        raise SystemExit("the verify steps did not take the paths the systems name")


if __name__ == "__main__":
    main()
