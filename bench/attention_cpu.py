#!/usr/bin/env python3
"""CPU paged attention: the per-sequence torch reference against the batched torch backend
(a script, not a test).

Two parts, each timing both backends in the same run, alternating one call of each per
round so that a busy machine slows both alike; the table gives the median (and the fastest)
wall time per call over ``--rounds`` rounds after a warm-up call, and the ratio of medians.

1. One attention call (one layer's ``forward``) with the demo model's shapes (8 query heads,
   4 kv heads, head_dim 32, float32 cache, block size 16) on a random cache, for decode
   batches of 1, 32 and 256 and one mixed step. Decode sequences hold 129..256 tokens
   (a 128-token prompt plus 1..128 generated tokens, drawn uniformly); block tables are
   shuffled. The mixed step is 64 such decodes plus a 256-token prompt's first chunk and a
   128-token chunk after 256 cached tokens. Each row also prints the largest difference
   between the two outputs.
2. A model step with the demo checkpoint: the runner's forward (embedding, 4 decoder layers
   over the paged cache, final norm) and LM head over 256 decoding sequences, as
   ``ModelRunner`` runs it minus sampling and bookkeeping, once per backend.

Every part runs once per ``--threads`` value (torch intra-op threads).

    python bench/attention_cpu.py                              # threads 1 and 2
    python bench/attention_cpu.py --threads 1 --rounds 5 --no-model
    python bench/attention_cpu.py --out bench/results/attention-cpu.txt   # also write the output there
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from conveyor.checkpoints.demo.checkpoint import ARCHITECTURE
from conveyor.worker.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata
from conveyor.worker.attention.torch_batched import TorchBatchedAttention
from conveyor.worker.attention.torch_ref import TorchReferenceAttention
from conveyor.worker.models.layers import RotaryEmbedding

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
HEADS = ARCHITECTURE["num_attention_heads"]
KV_HEADS = ARCHITECTURE["num_key_value_heads"]
HEAD_DIM = ARCHITECTURE["head_dim"]
PROMPT = 128  # decodes hold PROMPT + 1 .. 2 * PROMPT tokens

# name -> [(context_len, query_len)] given a generator
CASES: dict[str, Callable[[torch.Generator], list[tuple[int, int]]]] = {
    "decode x1": lambda g: _decodes(1, g),
    "decode x32": lambda g: _decodes(32, g),
    "decode x256": lambda g: _decodes(256, g),
    "mixed: 64 decodes + 256@0 + 128@256": lambda g: _decodes(64, g) + [(0, 256), (256, 128)],
}


def _decodes(n: int, generator: torch.Generator) -> list[tuple[int, int]]:
    return [(PROMPT + int(k), 1) for k in torch.randint(0, PROMPT, (n,), generator=generator)]


def _metadata(sequences: list[tuple[int, int]], generator: torch.Generator) -> tuple[AttentionMetadata, int]:
    """Metadata over shuffled blocks of a pool with a few spares, and the pool's size."""
    needed = [-(-(c + q) // BLOCK_SIZE) for c, q in sequences]
    num_blocks = sum(needed) + 16
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[free.pop() for _ in range(n)] for n in needed]
    metadata = AttentionMetadata.build([q for _, q in sequences], [c for c, _ in sequences], tables, BLOCK_SIZE, "cpu")
    return metadata, num_blocks


def _time_pair(
    ref: Callable[[], object], batched: Callable[[], object], rounds: int
) -> tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]]:
    """(wall, CPU) seconds of ``rounds`` calls of each, alternating, after one warm-up call of each.

    CPU time is the process's (all threads): on a shared machine it counts only the time this
    process ran, so it moves less than wall time when other work takes the cores.
    """
    ref()
    batched()
    wall: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for i, fn in enumerate((ref, batched)):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[i].append(time.perf_counter() - start)
            cpu[i].append(time.process_time() - start_cpu)
    return wall, cpu


def _row(name: str, times, extra: str = "") -> str:
    (ref, batched), (ref_cpu, batched_cpu) = times
    r, b = statistics.median(ref), statistics.median(batched)
    rc, bc = statistics.median(ref_cpu), statistics.median(batched_cpu)
    return (
        f"{name:<38} {r * 1e3:9.2f} ({min(ref) * 1e3:8.2f}) {b * 1e3:9.2f} ({min(batched) * 1e3:8.2f}) "
        f"{r / b:6.1f}x | {rc * 1e3:9.2f} {bc * 1e3:9.2f} {rc / bc:6.1f}x  {extra}"
    )


HEADER = (
    f"{'':<38} {'wall: reference ms':>20} {'batched ms':>20} {'ratio':>7} | "
    f"{'cpu: ref ms':>9} {'batched':>9} {'ratio':>7}"
)


def bench_attention(rounds: int, seed: int) -> list[str]:
    lines = ["attention forward, one layer: wall median (min) ms per call; process CPU median ms per call", HEADER]
    rotary = RotaryEmbedding(HEAD_DIM, 2 * PROMPT + 1, 10000.0, None, "cpu")  # forward reads no rotary table
    for name, make in CASES.items():
        generator = torch.Generator().manual_seed(seed)
        sequences = make(generator)
        metadata, num_blocks = _metadata(sequences, generator)
        cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
        query = torch.randn(sum(q for _, q in sequences), HEADS, HEAD_DIM, generator=generator)
        layer = AttentionLayer(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, None, rotary, kv_cache=cache)
        reference, batched = TorchReferenceAttention(), TorchBatchedAttention()

        def run(backend: AttentionBackend) -> Callable[[], torch.Tensor]:
            return lambda: backend.forward(layer, query, metadata)

        diff = (run(reference)() - run(batched)()).abs().max().item()
        times = _time_pair(run(reference), run(batched), rounds)
        lines.append(_row(name, times, f"max |diff| {diff:.1e}, {metadata.max_seq_len} max tokens"))
    return lines


def bench_model_step(rounds: int, seed: int, batch: int = 256) -> list[str]:
    from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir
    from conveyor.worker.kv_cache import KVCacheShape
    from conveyor.worker.loader import load_model

    directory = demo_checkpoint_dir()
    generator = torch.Generator().manual_seed(seed)
    sequences = _decodes(batch, generator)
    metadata, num_blocks = _metadata(sequences, generator)
    steps = {}
    for name, backend in (("reference", TorchReferenceAttention()), ("batched", TorchBatchedAttention())):
        model, config = load_model(directory, "cpu", "auto", backend)
        caches = KVCacheShape.of(config, BLOCK_SIZE, model.dtype).allocate(num_blocks, "cpu")
        for cache in caches:  # as if the prompts and earlier tokens had been computed
            cache.normal_(generator=generator)
        model.bind_kv_cache(caches)
        tokens = torch.randint(3, config.vocab_size, (batch,), generator=generator)
        positions = torch.tensor([c for c, _ in sequences])

        def step(model=model, tokens=tokens, positions=positions) -> torch.Tensor:
            with torch.inference_mode():
                return model.compute_logits(model(tokens, positions, metadata))

        steps[name] = step
    times = _time_pair(steps["reference"], steps["batched"], rounds)
    return [
        f"demo model step ({config.num_layers} layers, forward + LM head): wall median (min), CPU median ms per step",
        HEADER,
        _row(f"decode x{batch}", times),
    ]


def _environment() -> list[str]:
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout
        commit += " (uncommitted changes)" if dirty.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return [
        f"commit {commit}; torch {torch.__version__}; python {platform.python_version()}",
        f"cpu {cpu}, {os.cpu_count()} logical cores; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"demo shapes: {HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, block size {BLOCK_SIZE}, float32",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, action="append", help="torch threads (repeatable; default 1 and 2)")
    parser.add_argument("--rounds", type=int, default=9, help="timed calls of each backend per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-model", action="store_true", help="skip the demo model step")
    parser.add_argument("--out", type=Path, help="also write the output to this file")
    args = parser.parse_args(argv)

    lines: list[str] = []

    def emit(new: list[str]) -> None:
        for line in new:
            print(line, flush=True)
        lines.extend(new)

    emit(_environment())
    for threads in args.threads or [1, 2]:
        torch.set_num_threads(threads)
        emit(["", f"== torch threads: {threads}"])
        emit(bench_attention(args.rounds, args.seed))
        if not args.no_model:
            emit([""])
            emit(bench_model_step(args.rounds, args.seed))
    emit(["", f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
