#!/usr/bin/env python3
"""Host cost of a model-runner step: everything but the model, at N running decodes (a script, not a test).

The demo checkpoint is loaded as usual, then the model's forward and LM head are replaced by
stand-ins that return zeros of the right shapes, so what is timed is exactly the runner's
own work per step: checking the plan against its state, block tables and attention
metadata, input ids and positions, the sampler's bookkeeping, appending the tokens and
building the result. On a GPU this host time is what must hide behind the device's step
(docs/architecture.md, "Pipelined steps"); on a CPU it adds to it.

    python bench/worker_host.py                  # N = 64, 256, 1024
    python bench/worker_host.py --sizes 256 --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir
from conveyor.ipc.messages import CachedRequests, NewRequestData, SamplingParams, StepPlan
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
PROMPT = 8
BLOCKS_PER_REQUEST = 32  # room for 512 tokens each


def measure(n: int, steps: int) -> dict[str, float]:
    runner = ModelRunner(
        RunnerConfig(
            demo_checkpoint_dir(),
            block_size=BLOCK_SIZE,
            num_blocks=n * BLOCKS_PER_REQUEST + 1,
            dtype="float32",
        ),
    )
    hidden = runner.model_config.hidden_size
    vocab = runner.model_config.vocab_size
    hidden_states, logits = torch.zeros(n * PROMPT, hidden), torch.zeros(n, vocab)  # allocated once
    runner.model.forward = lambda tokens, positions, metadata: hidden_states[: len(tokens)]
    runner.model.compute_logits = lambda h: logits[: len(h)]
    greedy = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    news = [
        NewRequestData(
            f"r{i}",
            i,
            [5 + i % 50] * PROMPT,
            greedy,
            list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)),
            0,
            PROMPT,
        )
        for i in range(n)
    ]
    runner.execute(StepPlan(1, news, CachedRequests(), []))
    computed = PROMPT
    times = []
    for step in range(2, steps + 2):
        plan = StepPlan(step, [], CachedRequests(list(range(n)), [computed] * n, [1] * n), [])
        start = time.perf_counter()
        result = runner.execute(plan)
        times.append(time.perf_counter() - start)
        assert len(result.sampled_token_ids) == n
        computed += 1
    times.sort()
    return {"p50_ms": statistics.median(times) * 1e3, "p90_ms": times[int(0.9 * len(times))] * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per size (at most 512 - 8 - 2)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'decodes':>8} {'p50 ms':>8} {'p90 ms':>8}")
    for n in args.sizes:
        r = measure(n, min(args.steps, BLOCKS_PER_REQUEST * BLOCK_SIZE - PROMPT - 2))
        print(f"{n:>8} {r['p50_ms']:>8.3f} {r['p90_ms']:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
