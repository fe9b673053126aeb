#!/usr/bin/env python3
"""Decode step time of the ModelRunner beside its roofline and HF (a script, not a test).

For the 1B-class Llama of the GPU baseline (hidden 2048, intermediate 8192, 16 layers, 32/8
heads, vocab 4096; random bf16 weights written to a temporary directory), at each batch size
and context: the wall time of ``ModelRunner.execute`` of a decode step (every request one new
token; host preparation, device work and the wait for the sampled ids), with CUDA graphs and
with ``enforce_eager``; the roofline (weight bytes + the batch's KV bytes over the device's
measured copy bandwidth, read + write of a large ``copy_``); an HF ``LlamaForCausalLM`` forward
of one new token per sequence over a cache of the same length (same weights, same run); and,
from torch.profiler, kernel launches per step (CUDA) and torch operators per step (any
device) and per layer.

Requests enter with their context already counted as computed (the KV blocks hold whatever
they hold): a decode step's cost does not depend on the values, so no prefill is run.

    python bench/decode_step.py --out bench/results/decode-step.json      # CUDA, full grid
    python bench/decode_step.py --smoke --out /tmp/decode-step.json        # tiny, CPU, seconds
    python bench/decode_step.py --checkpoint /tmp/llama-1b --out x.json    # a checkpoint already written

The JSON is rewritten after every row, so a run stopped at its time limit keeps the rows it
measured; the HF forward runs last, in a try, so its failure costs only its own columns.
``--checkpoint`` reuses a directory :func:`write_checkpoint` filled (bench/gpu_checks.py
builds the 1B checkpoint once for every stage); its ``config.json`` is the model.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from conveyor.ipc.messages import CachedRequests, NewRequestData, SamplingParams, StepPlan  # noqa: E402
from conveyor.runtime.config import RunnerConfig  # noqa: E402
from conveyor.worker.model_runner import ModelRunner  # noqa: E402

# The GPU baseline's model (../shared/gpu-baseline/decode_step_profile.py, docs/benchmarks.md).
MODEL_1B = dict(
    vocab_size=4096,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)
MODEL_SMOKE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "decode-step.json")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU, batch 1 and 4, context 32 (CI)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,32,128,256")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per point (after 3 warm-up steps)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF forward")
    p.add_argument("--checkpoint", type=Path, help="an existing checkpoint directory (default: write one)")
    return p.parse_args(argv)


def write_checkpoint(config: dict, dtype: torch.dtype, directory: Path, tokenizer: bool = False) -> None:
    """Random Llama weights (seed 0) in ``directory``; ``tokenizer``: the demo tokenizer beside
    them, so bin/serve and bin/bench can load the directory too (its vocabulary is 4096)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).to(dtype).save_pretrained(directory)
    if tokenizer:
        from conveyor.checkpoints.demo import checkpoint as demo

        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo.TOKENIZER_DIR / name, Path(directory) / name)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device copy, read + write counted (the roofline's bandwidth)."""
    n = (1 << 30) if device.type == "cuda" else (16 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n / min(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DecodeLoad:
    """``batch`` requests at ``context`` computed tokens on a runner, stepped one token at a time."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, steps: int, step_id: int) -> None:
        self.runner = runner
        per_request = -(-(context + steps + 1) // BLOCK_SIZE)
        tokens = [5 + i % 50 for i in range(context + 1)]
        new = [
            NewRequestData(f"r{i}", i, tokens, GREEDY, list(range(i * per_request, (i + 1) * per_request)), context, 1)
            for i in range(batch)
        ]
        self.batch, self.computed, self.step_id = batch, context + 1, step_id
        runner.execute(StepPlan(step_id, new, CachedRequests(), []))

    def step(self) -> None:
        self.step_id += 1
        rows = CachedRequests(list(range(self.batch)), [self.computed] * self.batch, [1] * self.batch)
        self.runner.execute(StepPlan(self.step_id, [], rows, []))
        self.computed += 1

    def close(self) -> int:
        self.step_id += 1
        self.runner.execute(StepPlan(self.step_id, [], CachedRequests(), list(range(self.batch))))
        return self.step_id + 1


def time_steps(load: DecodeLoad, steps: int, device: torch.device) -> dict[str, float]:
    for _ in range(3):
        load.step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        load.step()
        sync(device)
        times.append(time.perf_counter() - start)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}


def profile_steps(load: DecodeLoad, device: torch.device, num_layers: int, steps: int = 3) -> dict[str, float]:
    """Kernel launches (CUDA) and torch operators per step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            load.step()
        sync(device)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in LAUNCH_EVENTS) / steps
    operators = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    return {
        "kernel_launches_per_step": launches,
        "torch_ops_per_step": operators,
        "torch_ops_per_layer": operators / num_layers,
    }


def hf_decode_ms(model, batch: int, context: int, steps: int, device: torch.device) -> float:
    """One HF forward of a new token per sequence over a ``context``-token cache (random KV)."""
    from transformers import DynamicCache

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (batch, config.num_key_value_heads, context, head_dim)
    dtype = next(model.parameters()).dtype
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        cache.update(
            torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device), layer
        )
    ids = torch.full((batch, 1), 7, dtype=torch.int64, device=device)
    positions = torch.full((batch, 1), context, dtype=torch.int64, device=device)
    times = []
    with torch.inference_mode():
        for i in range(steps + 2):
            sync(device)
            start = time.perf_counter()
            model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
            cache.crop(context - cache.get_seq_length())  # negative: drop the token just added
    return 1e3 * statistics.median(times)


def versions(device: torch.device) -> dict[str, str]:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    try:
        out["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batches = [1, 4] if args.smoke else [int(b) for b in args.batches.split(",")]
    contexts = [32] if args.smoke else [int(c) for c in args.contexts.split(",")]
    steps = 3 if args.smoke else args.steps
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    graph_modes = [False, True] if device.type == "cuda" else [False]

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.checkpoint or Path(tmp)
        if args.checkpoint is None:
            write_checkpoint(MODEL_SMOKE if args.smoke else MODEL_1B, dtype, directory)
        config = json.loads((directory / "config.json").read_text())
        result: dict = {
            "config": {k: config.get(k) for k in MODEL_1B},
            "dtype": str(dtype),
            "block_size": BLOCK_SIZE,
            "versions": versions(device),
            "rows": [],
        }
        result["copy_bandwidth_gbps"] = copy_bandwidth(device) / 1e9
        run_grid(args, result, directory, device, dtype, batches, contexts, steps, graph_modes)
        if not args.no_hf:
            try:
                add_hf(result, directory, device, dtype, steps, args.out)
            except Exception as exc:  # the grid's rows stand without HF's columns
                result["hf_error"] = f"{type(exc).__name__}: {exc}"[:1000]
                print(f"HF forward failed: {result['hf_error']}", file=sys.stderr)
    write(result, args.out)
    print_table(result)
    return result


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def run_grid(args, result: dict, directory: Path, device, dtype, batches, contexts, steps, graph_modes) -> None:
    """Every (graphs, context, batch) row, appended to ``result`` and written as it lands."""
    rows = result["rows"]
    bandwidth = result["copy_bandwidth_gbps"] * 1e9
    num_layers = result["config"]["num_hidden_layers"]
    max_batch = max(batches)
    num_blocks = max_batch * -(-(max(contexts) + steps + 16) // BLOCK_SIZE)
    for graphs in graph_modes:
        start = time.perf_counter()
        runner = ModelRunner(
            RunnerConfig(
                directory,
                device=str(device),
                dtype=dtype,
                block_size=BLOCK_SIZE,
                num_blocks=num_blocks,
                max_num_seqs=max_batch,
                enforce_eager=not graphs,
            ),
        )
        startup = {"startup_s": time.perf_counter() - start}
        if runner.decode.graphs is not None:
            startup.update(
                graphs=len(runner.decode.graphs),
                capture_s=runner.decode.graphs.capture_seconds,
                graph_memory_mib=runner.decode.graphs.memory_bytes / 2**20,
            )
        result.setdefault("startup", {})["graphs" if graphs else "eager"] = startup
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_per_token = runner.block_bytes // BLOCK_SIZE
        step_id = 0
        for context in contexts:
            for batch in batches:
                load = DecodeLoad(runner, batch, context, steps + 10, step_id)
                row = {"graphs": graphs, "batch": batch, "context": context}
                row.update(time_steps(load, steps, device))
                row.update(profile_steps(load, device, num_layers))
                roofline_bytes = weight_bytes + batch * (context + 1) * kv_per_token
                row["roofline_ms"] = 1e3 * roofline_bytes / bandwidth
                row["tokens_per_s"] = batch / (row["median_ms"] / 1e3)
                step_id = load.close()
                rows.append(row)
                write(result, args.out)
                print(json.dumps(row), flush=True)
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def add_hf(result: dict, directory: Path, device, dtype, steps: int, out: Path) -> None:
    """HF's forward at each (batch, context) of the grid, beside both graph modes' rows."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    hf: dict[tuple[int, int], float] = {}
    for row in result["rows"]:
        key = (row["batch"], row["context"])
        if key not in hf:
            hf[key] = hf_decode_ms(model, *key, steps, device)
        row["hf_ms"] = hf[key]
        row["speedup_over_hf"] = row["hf_ms"] / row["median_ms"]
        write(result, out)


def print_table(result: dict) -> None:
    print(f"{result['versions'].get('device')}: copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s")
    print(
        f"{'graphs':>6} {'batch':>5} {'ctx':>5} {'step ms':>8} {'roofline':>8} {'HF ms':>8} {'launches':>8} "
        f"{'ops/layer':>9}"
    )
    for r in result["rows"]:
        hf = r.get("hf_ms")
        print(
            f"{str(r['graphs']):>6} {r['batch']:>5} {r['context']:>5} {r['median_ms']:>8.3f} {r['roofline_ms']:>8.3f} "
            f"{(f'{hf:.3f}' if hf is not None else '-'):>8} {r['kernel_launches_per_step']:>8.0f} "
            f"{r['torch_ops_per_layer']:>9.1f}"
        )


if __name__ == "__main__":
    main()
