"""How far an 8-bit KV cache (``--kv-cache-dtype fp8|int8``) moves a real model's greedy
output from the model-dtype cache's: bin/eval's items as chats, greedy, on the CPU.

For each 8-bit dtype, against the ``auto`` cache's greedy replies:
- items whose reply is identical, and the fraction of reply tokens identical (position by
  position up to each item's first difference, over all tokens);
- teacher-forced: the ``auto`` replies fed back as prompts to the 8-bit cache, the fraction of
  their tokens that are also its argmax, and the largest (and mean) absolute difference of
  their log-probabilities.

    PYTHONPATH=src:. python3 bench/kv_cache_8bit.py --model ~/.cache/conveyor/.../SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json

from conveyor import Engine
from conveyor_tools.eval.tasks import tasks


def _run(engine: Engine, requests: list) -> None:
    while engine.has_pending_requests():
        engine.step()
    for request in requests:
        assert request.error is None, request.error


def greedy(engine: Engine, items, max_tokens: int) -> list:
    requests = [
        engine.add_request(messages=item.messages(), max_tokens=max_tokens, temperature=0.0, logprobs=1)
        for item in items
    ]
    _run(engine, requests)
    return requests


def forced(engine: Engine, replies: list) -> list:
    """The 8-bit engine's prompt log-probabilities (top 1) over each prompt + reference reply."""
    requests = [
        engine.add_request(token_ids=r.prompt_token_ids + r.tokens, max_tokens=1, temperature=0.0, prompt_logprobs=1)
        for r in replies
    ]
    _run(engine, requests)
    return requests


def compare(reference: list, quantized: list, teacher: list) -> dict:
    same_items = same_tokens = total = agree = 0
    errors: list[float] = []
    for ref, q, t in zip(reference, quantized, teacher):
        same_items += ref.tokens == q.tokens
        prefix = next(
            (i for i, (a, b) in enumerate(zip(ref.tokens, q.tokens)) if a != b), min(len(ref.tokens), len(q.tokens))
        )
        same_tokens += prefix
        total += len(ref.tokens)
        n = len(ref.prompt_token_ids)
        for entry, mine in zip(t.prompt_logprobs[n:], ref.logprobs):
            errors.append(abs(entry.logprob - mine.logprob))
            agree += entry.top[0].token_id == entry.token_id
    return {
        "items": len(reference),
        "identical_items": same_items,
        "identical_token_fraction": same_tokens / total,
        "teacher_forced_top1_agreement": agree / len(errors),
        "max_logprob_error": max(errors),
        "mean_logprob_error": sum(errors) / len(errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--every", type=int, default=1, help="every K-th item only (all categories still drawn)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="fp8,int8")
    args = parser.parse_args()
    items = tasks()[:: args.every]
    config = dict(device="cpu", threads=args.threads, kv_cache_memory=0.25, max_num_seqs=len(items))
    engine = Engine(args.model, **config)
    reference = greedy(engine, items, args.max_tokens)
    engine.close()
    report = {}
    for kv in args.dtypes.split(","):
        engine = Engine(args.model, kv_cache_dtype=kv, **config)
        quantized = greedy(engine, items, args.max_tokens)
        report[kv] = compare(reference, quantized, forced(engine, reference))
        engine.close()
        print(kv, json.dumps(report[kv]), flush=True)


if __name__ == "__main__":
    main()
