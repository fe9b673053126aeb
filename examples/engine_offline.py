"""conveyor.Engine in one process: requests added between steps, a continuation, an offline batch.

Runs on the default model, SmolLM2-135M-Instruct (fetched once into the cache); pass --model
for another checkpoint directory or GGUF file, or --model demo for the random demo model:

    python examples/engine_offline.py [--model DIR|FILE.gguf|demo] [--max-tokens N]
"""

from __future__ import annotations

import argparse

from conveyor import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="local HF checkpoint directory, GGUF file or 'demo' (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    # TGI-style limits: at most 8 sequences and 512 tokens per iteration.
    engine = Engine(args.model, max_batch_size=8, max_batch_tokens=512, num_kv_blocks=1024)
    greedy = dict(max_tokens=args.max_tokens, temperature=0.0)

    def show(out) -> None:
        """Print an iteration that admitted requests; take every request's new tokens."""
        b = out.batch
        if b is not None and b.num_admitted:
            print(
                f"step {b.step}: {b.batch_size} requests, {b.input_tokens} input tokens, "
                f"admitted {b.num_admitted} (max wait {b.max_wait * 1e3:.2f} ms)"
            )
        for request in out.requests:
            if request.has_available_tokens():
                request.take_new()  # a streaming caller would print this delta

    # 1. Step by step: a request joins while another runs.
    first = engine.add_request("The quick brown fox", request_id="fox", **greedy)
    show(engine.step())
    second = engine.add_request(messages=[{"role": "user", "content": "Say hello."}], request_id="chat", **greedy)
    while engine.has_pending_requests():
        show(engine.step())
    for request in (first, second):
        print(f"{request.request_id}: {request.finish_reason}, {len(request.tokens)} tokens: {request.text!r}")

    # 2. Continue the finished "fox" request: its KV comes from the prefix cache.
    more = engine.add_request(" jumps over", request_id="fox", **greedy)
    while not more.done:
        engine.step()
    print(f"fox, continued: {more.num_cached_tokens} of {more.num_prompt_tokens} prompt tokens cached: {more.text!r}")
    more.remove()
    second.remove()

    # 3. An offline batch, run to the end.
    prompts = [f"Item {i}:" for i in range(12)]
    for result in engine.generate(prompts, **greedy):
        print(f"{result.finish_reason:>6} {len(result.token_ids):3d} tokens  {result.text[:40]!r}")


if __name__ == "__main__":
    main()
