#!/usr/bin/env python3
"""The GPU window's first real stage (bench/gpu_checks.py "smoke", under 60 s on a GPU): does
the CUDA path run at all, and the figure that matters most, before anything slower.

On the benchmark checkpoint (bench/gpu_checks.py writes it; the 1B-class Llama on a GPU):

1. build the ModelRunner with CUDA graphs (every decode bucket captured; the startup time,
   the graph count, capture seconds and memory recorded);
2. time one synchronized decode step at each ``--batches`` (default 1 and 128) at context
   ``--context`` (512): the median of ``--steps`` steps through the graphs, the targets'
   figure (issue 24: <= 1.0 ms at batch 1, <= 1.5 ms at batch 128), written first;
3. prefill one prompt of each length class (``--prompt-lens``: under a block, the workloads'
   128 tokens, and past the first context bound of 512, so every prefill kernel class and two
   context bounds of the decode graphs run), each in its own step, then greedy-decode
   ``--new-tokens`` for all of them together; the same on an eager runner (the same decode
   buckets: the same kernels, not replayed); the tokens must be equal.

The JSON is rewritten after each part, so a stage stopped at its limit keeps what it reached.
Exit status 1 when graphs and eager disagree. On a CPU (``--device cpu``: the dry run) there
are no graphs: both runners run eagerly and the comparison checks only the plumbing.

    python bench/gpu_smoke.py --checkpoint DIR --out smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from decode_step import BLOCK_SIZE, GREEDY, DecodeLoad, time_steps  # noqa: E402

from conveyor.ipc.messages import CachedRequests, NewRequestData, StepPlan  # noqa: E402
from conveyor.runtime.config import RunnerConfig  # noqa: E402
from conveyor.worker.model_runner import ModelRunner  # noqa: E402

#: The targets the decode figure is read against (issue 24), by batch size.
TARGET_MS = {1: 1.0, 128: 1.5}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,128")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size (after 3 warm-up steps)")
    p.add_argument("--prompt-lens", default="3,128,700", help="one prompt of each length class")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, help="torch CPU threads (the dry run's one)")
    return p.parse_args(argv)


def runner_for(
    args: argparse.Namespace, device: torch.device, graphs: bool, num_blocks: int, max_seqs: int
) -> ModelRunner:
    """``pad_decode`` on both: the eager runner pads to the same buckets, so the same kernels run."""
    return ModelRunner(
        RunnerConfig(
            str(args.checkpoint),
            device=str(device),
            dtype=getattr(torch, args.dtype),
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            max_num_seqs=max_seqs,
            enforce_eager=not graphs,
            pad_decode=True,
        )
    )


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, step_id: int) -> tuple[list[list[int]], int]:
    """Each prompt prefilled in its own step (slot i, blocks after the previous prompt's), then
    ``new_tokens - 1`` decode steps of all of them; their greedy tokens and the last step id."""
    out: list[list[int]] = [[] for _ in prompts]
    first_block = 0
    for i, prompt in enumerate(prompts):
        blocks = -(-(len(prompt) + new_tokens) // BLOCK_SIZE)
        step_id += 1
        new = NewRequestData(f"g{i}", i, prompt, GREEDY, list(range(first_block, first_block + blocks)), 0, len(prompt))
        first_block += blocks
        collect(runner.execute(StepPlan(step_id, [new], CachedRequests(), [])), out)
    slots = list(range(len(prompts)))
    for k in range(new_tokens - 1):
        step_id += 1
        rows = CachedRequests(slots, [len(p) + k for p in prompts], [1] * len(prompts))
        collect(runner.execute(StepPlan(step_id, [], rows, [])), out)
    step_id += 1
    runner.execute(StepPlan(step_id, [], CachedRequests(), slots))
    return out, step_id


def collect(result, out: list[list[int]]) -> None:
    if result.error:
        raise RuntimeError(f"step {result.step_id} failed: {result.error}")
    for slot, token in zip(result.slots, result.sampled_token_ids):
        out[slot].append(int(token))


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    config = json.loads((args.checkpoint / "config.json").read_text())
    vocab, max_position = config["vocab_size"], config["max_position_embeddings"]
    if max(lengths) + args.new_tokens > max_position or args.context + args.steps + 16 > max_position:
        raise SystemExit(f"gpu_smoke: --prompt-lens and --context must fit the model's {max_position} positions")
    per_request = -(-(args.context + args.steps + 16) // BLOCK_SIZE)
    num_blocks = max(max(batches) * per_request, sum(-(-(n + args.new_tokens) // BLOCK_SIZE) for n in lengths))
    max_seqs = max(max(batches), len(lengths))
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "context": args.context,
        "decode_step": [],
    }

    start = time.perf_counter()
    runner = runner_for(args, device, True, num_blocks, max_seqs)
    graphs = runner.decode.graphs
    result["startup"] = {
        "graphs_runner_s": round(time.perf_counter() - start, 2),
        "graphs": len(graphs) if graphs is not None else None,
        "capture_s": graphs.capture_seconds if graphs is not None else None,
        "graph_memory_mib": graphs.memory_bytes / 2**20 if graphs is not None else None,
    }
    write(result, args.out)
    print(f"graphs runner in {result['startup']['graphs_runner_s']} s: {result['startup']}", flush=True)

    step_id = 0
    for batch in batches:  # the figure first
        load = DecodeLoad(runner, batch, args.context, args.steps + 10, step_id)
        row = {
            "batch": batch,
            "graphs": graphs is not None,
            **time_steps(load, args.steps, device),
            "target_ms": TARGET_MS.get(batch),
        }
        step_id = load.close()
        result["decode_step"].append(row)
        write(result, args.out)
        print(
            f"decode step batch {batch} ctx {args.context}: {row['median_ms']:.3f} ms (target {row['target_ms']})",
            flush=True,
        )

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    tokens = {}
    tokens["graphs"], step_id = greedy(runner, prompts, args.new_tokens, step_id)
    del runner, graphs, load  # the graphs' memory goes before the eager runner's comes
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tokens["eager"], _ = greedy(runner_for(args, device, False, num_blocks, max_seqs), prompts, args.new_tokens, 0)
    equal = tokens["graphs"] == tokens["eager"]
    result["greedy"] = {"prompt_lens": lengths, "new_tokens": args.new_tokens, "graphs_equal_eager": equal, **tokens}
    result["seconds"] = round(time.perf_counter() - start, 2)
    write(result, args.out)
    print(
        f"greedy tokens, graphs == eager: {equal} (prompts of {lengths} tokens, {args.new_tokens} new each)", flush=True
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
