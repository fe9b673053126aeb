#!/usr/bin/env python3
"""Throughput with many LoRA adapters against the base model alone (a script, not a test).

On the demo model (``conveyor.Engine()``, CPU and float32 unless ``--device``/``--dtype``), rank-16
adapters on all seven targets (random PEFT-format directories written to a temporary folder): 64
requests (prompts of 64 token ids, 64 greedy output tokens each, ignore_eos) run to completion,
three ways in the same process, interleaved ``--repeats`` times (the best of each kept):

- ``plain``: an engine without LoRA (no stacks attached);
- ``base``: the LoRA engine (8 adapters registered), every request on the base model (the
  host flag: a step without adapter rows skips the LoRA path);
- ``adapters``: the same engine, request ``i`` on adapter ``i % 8`` (8 adapters in every step).

Every run has prompts of its own (no prefix-cache hits from an earlier run).

Output tokens per second of each, ``adapters / base``, and where the adapters' time goes:
the seconds spent in :meth:`LoraStack.add_delta` (gather, shrink, expand, scatter of every
fused projection) against the whole run.

    python bench/lora.py --out bench/results/lora.json
    python bench/lora.py --smoke        # 16 requests, 16 tokens: seconds
    python bench/lora.py --device cuda --dtype bfloat16    # bench/gpu_checks.py's "lora" stage

On CUDA the deltas are the Triton shrink/expand kernels (:mod:`conveyor.kernels.lora`) and a
decode step with adapter rows runs eagerly (the captured graphs hold no LoRA), so there the
ratio also prices the graphs the adapters' steps give up; the time "in adapter deltas" is then
the device's, from CUDA events around each delta (:class:`DeltaTimer`), and each run's clock
starts and stops on a synchronized device.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from conveyor import Engine
from conveyor.checkpoints.model_config import ModelConfig
from conveyor.worker import lora_delta

TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A PEFT-format LoRA of ``config`` with random non-zero A and B on every target."""
    directory.mkdir(parents=True)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, m = config.hidden_size, config.intermediate_size
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, m),
        "up_proj": (h, m),
        "down_proj": (m, h),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, sub in TARGETS.items():
            d_in, d_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{sub}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator) * 0.05
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)})
    )


class DeltaTimer:
    """Seconds spent inside :meth:`LoraStack.add_delta`. On CUDA the device's: a pair of CUDA
    events around each call, read once the run is over (the host returns from the launches
    long before the kernels end, so a host clock there would time the launches; a synchronize
    per call would serialize the steps being measured). Elsewhere the host's, which is the
    device's there."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self._host = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, add_delta):
        def timed(stack, x, y):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = add_delta(stack, x, y)
                end.record()
                self._events.append((start, end))
                return out
            start = time.perf_counter()
            out = add_delta(stack, x, y)
            self._host += time.perf_counter() - start
            return out

        return timed

    def reset(self) -> None:
        self._host, self._events = 0.0, []

    def seconds(self) -> float:
        if not self.cuda:
            return self._host
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self._events) / 1e3


def sync(engine: Engine) -> None:
    """The device idle before the clock starts and after it stops (the last step's tokens are
    read back, but the run's timing must not hang on that)."""
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def run(engine: Engine, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> tuple[float, int]:
    sync(engine)
    start = time.perf_counter()
    requests = [
        engine.add_request(
            token_ids=p, request_id=f"q{i}", max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=lora
        )
        for i, (p, lora) in enumerate(zip(prompts, loras))
    ]
    while engine.has_pending_requests():
        engine.step()
    sync(engine)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in requests)
    for r in requests:
        r.remove()
    return seconds, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    if args.smoke:
        args.requests, args.prompt_len, args.max_tokens, args.repeats = 16, 16, 16, 1
    common = dict(
        device=args.device, dtype=args.dtype, threads=args.threads, num_kv_blocks=1024, max_num_seqs=args.requests
    )
    plain = Engine(**common)
    config = ModelConfig.from_dir(plain.model_dir)
    generator = torch.Generator().manual_seed(0)

    def fresh_prompts() -> list[list[int]]:
        """New random prompts for every run: a repeat must not hit the prefix cache of an earlier one."""
        return [
            torch.randint(3, config.vocab_size, (args.prompt_len,), generator=generator).tolist()
            for _ in range(args.requests)
        ]

    names = [f"lora{k}" for k in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(names):
            write_adapter(Path(tmp, name), config, args.rank, seed=k)
        engine = Engine(
            **common,
            lora_modules={name: str(Path(tmp, name)) for name in names},
            max_loras=args.adapters,
            max_lora_rank=args.rank,
        )
    # Time inside the adapters' deltas (every fused projection's gather/shrink/expand/scatter).
    deltas = DeltaTimer(args.device)
    lora_delta.LoraStack.add_delta = deltas.wrap(lora_delta.LoraStack.add_delta)
    runs = {
        "plain": (plain, [None] * args.requests),
        "base": (engine, [None] * args.requests),
        "adapters": (engine, [names[i % args.adapters] for i in range(args.requests)]),
    }
    run(plain, fresh_prompts()[:2], [None, None], 2)  # warm-up
    results: dict[str, dict] = {}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits all three alike
        for label, (which, loras) in runs.items():
            deltas.reset()
            seconds, tokens = run(which, fresh_prompts(), loras, args.max_tokens)
            if label not in results or seconds < results[label]["seconds"]:
                results[label] = {
                    "seconds": round(seconds, 3),
                    "tokens": tokens,
                    "tok_s": round(tokens / seconds, 1),
                    "lora_delta_seconds": round(deltas.seconds(), 3),
                }
            print(label, results[label], flush=True)
    ratio = results["adapters"]["tok_s"] / results["base"]["tok_s"]
    summary = {
        "model": "demo (hidden 256, 4 layers, intermediate 688)",
        "device": args.device,
        "dtype": args.dtype,
        "rank": args.rank,
        "adapters": args.adapters,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "runs": results,
        "adapters_over_base": round(ratio, 3),
        "base_over_plain": round(results["base"]["tok_s"] / results["plain"]["tok_s"], 3),
        "delta_share_of_adapters_run": round(
            results["adapters"]["lora_delta_seconds"] / results["adapters"]["seconds"], 3
        ),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
