#!/usr/bin/env python3
"""Benchmark Conveyor's Triton kernels on a CUDA device (a script, not a test).

For each kernel and shape: warm up (compiles), then time ``--iters`` calls one by one with CUDA
events and report the median. Inputs rotate through enough distinct copies (for the attention
kernels: disjoint block ranges of one large pool) that one round touches more than twice the
L2 cache, so every call streams from HBM as it would in a real model step.

Achieved bandwidth counts only the bytes a kernel must move (K/V it attends to, queries,
outputs, copied blocks; not its scratch traffic) and is compared with the device's own copy
bandwidth, measured in the same run with a large device-to-device ``copy_`` (read + write
bytes over time). Swaps are compared with measured pinned host<->device copy bandwidth instead.
Extend attention, which is compute-bound, also reports TFLOP/s (causal FLOPs only).

    python bench/kernel_timings.py --out bench/out/kernels.json            # full set
    python bench/kernel_timings.py --quick --kernels decode,extend          # a subset, fewer shapes

Writes JSON with the device name, torch/triton versions, git commit and every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = ("kv_store", "decode", "extend", "copy_blocks", "swap")

# kv_store: tokens; decode: (batch, context); extend: (batch, cached context, new tokens each);
# copy_blocks: (src, dst) pairs; swap: blocks per direction.
SHAPES: dict[str, list] = {
    "kv_store": [1, 256, 8192],
    "decode": [(1, 1024), (1, 32768), (8, 4096), (64, 2048), (256, 1024)],
    "extend": [(1, 0, 2048), (4, 0, 1024), (1, 8192, 512), (16, 1024, 128)],
    "copy_blocks": [16, 256],
    "swap": [64, 512],
}
QUICK_SHAPES: dict[str, list] = {
    "kv_store": [256, 8192],
    "decode": [(1, 32768), (64, 2048)],
    "extend": [(1, 0, 2048), (1, 8192, 512)],
    "copy_blocks": [256],
    "swap": [512],
}


@dataclasses.dataclass
class Row:
    kernel: str
    config: str
    median_us: float
    p10_us: float
    p90_us: float
    bytes: int
    gbps: float
    pct_of_peak: float  # of the measured copy bandwidth that applies (device or host link)
    tflops: float | None = None

    @classmethod
    def measured(
        cls,
        kernel: str,
        config: str,
        timing: tuple[float, float, float],
        moved: int,
        peak_gbps: float,
        flops: int | None = None,
    ) -> Row:
        """The row of a ``timer`` result ``(median, p10, p90)`` in microseconds: bandwidth from
        the bytes ``moved`` per call, as a share of ``peak_gbps`` (the copy bandwidth that applies)."""
        med, p10, p90 = timing
        gbps = moved / med / 1e3
        tflops = flops / med / 1e6 if flops is not None else None
        return cls(kernel, config, med, p10, p90, moved, gbps, 100 * gbps / peak_gbps, tflops)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "kernels.json", help="JSON output path")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {','.join(KERNELS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    p.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3-8B: 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32, help="layers moved by copy_blocks / swap")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


def git_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Timer:
    """Median-of-N CUDA-event timing of a callable taking the iteration index."""

    def __init__(self, torch_mod, warmup: int, iters: int) -> None:
        self.torch = torch_mod
        self.warmup = warmup
        self.iters = iters

    def __call__(self, fn: Callable[[int], object]) -> tuple[float, float, float]:
        torch = self.torch
        for i in range(self.warmup):
            fn(i)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            starts[i].record()
            fn(self.warmup + i)
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))  # microseconds
        q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
        return statistics.median(times), q(0.1), q(0.9)


def measure_bandwidth(torch, timer: Timer, device) -> dict[str, float]:
    """GB/s of a 1 GiB device-to-device copy (read + write) and of 256 MiB pinned H2D / D2H."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    d2d_us, _, _ = timer(lambda i: dst.copy_(src))
    src = dst = None  # frees the device memory (the timed lambda reads these names, so no del)
    m = 256 << 20
    host = torch.empty(m, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(m, dtype=torch.uint8, device=device)
    h2d_us, _, _ = timer(lambda i: dev.copy_(host, non_blocking=True))
    d2h_us, _, _ = timer(lambda i: host.copy_(dev, non_blocking=True))
    return {
        "device_copy_gbps": 2 * n / d2d_us / 1e3,
        "h2d_gbps": m / h2d_us / 1e3,
        "d2h_gbps": m / d2h_us / 1e3,
    }


def rotations(bytes_per_input: int, l2_bytes: int, cap: int = 64) -> int:
    """How many distinct input copies make one rotation stream > 2x L2."""
    return max(2, min(cap, math.ceil(2 * l2_bytes / max(1, bytes_per_input)) + 1))


def paged_pool(torch, rot: int, seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype, device):
    """One cache with ``rot`` disjoint, shuffled sets of blocks for the given sequences, and the
    block tables of each set."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    per_rot = sum(per_seq)
    num_blocks = per_rot * rot
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    width = max(per_seq)
    tables = []
    for r in range(rot):
        table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
        taken = r * per_rot
        for b, n in enumerate(per_seq):
            table[b, :n] = order[taken : taken + n]
            taken += n
        tables.append(table)
    return kv, tables


def bench_kv_store(torch, args, timer, dtype, l2, device, bw) -> list[Row]:
    from conveyor.kernels.kv_store import kv_store

    rows = []
    shapes = SHAPES["kv_store"] if not args.quick else QUICK_SHAPES["kv_store"]
    elem = torch.empty((), dtype=dtype).element_size()
    for tokens in shapes:
        tok_bytes = 2 * args.kv_heads * args.head_dim * elem
        rot = rotations(2 * tokens * tok_bytes, l2)
        blocks_per_rot = -(-tokens // args.block_size)
        kv_shape = (2, blocks_per_rot * rot, args.block_size, args.kv_heads, args.head_dim)
        kv = torch.randn(kv_shape, device=device, dtype=dtype)
        keys = [torch.randn(tokens, args.kv_heads, args.head_dim, device=device, dtype=dtype) for _ in range(rot)]
        vals = [torch.randn_like(k) for k in keys]
        perm = torch.randperm(blocks_per_rot * rot * args.block_size, device=device)
        slots = [perm[r * tokens : (r + 1) * tokens].contiguous() for r in range(rot)]
        timing = timer(lambda i: kv_store(keys[i % rot], vals[i % rot], kv, slots[i % rot]))
        moved = 2 * tokens * tok_bytes + tokens * 8
        rows.append(Row.measured("kv_store", f"T={tokens}", timing, moved, bw["device_copy_gbps"]))
    return rows


def bench_decode(torch, args, timer, dtype, l2, device, bw) -> list[Row]:
    from conveyor.kernels.paged_decode import paged_decode_attention

    shapes = SHAPES["decode"] if not args.quick else QUICK_SHAPES["decode"]
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for batch, ctx in shapes:
        lens = [ctx] * batch
        kv_bytes = batch * ctx * 2 * args.kv_heads * args.head_dim * elem
        rot = rotations(kv_bytes, l2)
        kv, tables = paged_pool(torch, rot, lens, args.block_size, args.kv_heads, args.head_dim, dtype, device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        qs = [torch.randn(batch, args.heads, args.head_dim, device=device, dtype=dtype) for _ in range(rot)]
        out = torch.empty_like(qs[0])
        scale = args.head_dim**-0.5
        timing = timer(
            lambda i: paged_decode_attention(
                qs[i % rot], kv, tables[i % rot], seq_lens, scale, max_seq_len=ctx, out=out
            )
        )
        moved = kv_bytes + 2 * qs[0].numel() * elem + tables[0].numel() * 4
        rows.append(Row.measured("decode", f"B={batch} ctx={ctx}", timing, moved, bw["device_copy_gbps"]))
        kv = tables = qs = None  # frees the pool before the next shape's (no del: a lambda reads them)
    return rows


def bench_extend(torch, args, timer, dtype, l2, device, bw) -> list[Row]:
    from conveyor.kernels.extend_attention import extend_attention

    shapes = SHAPES["extend"] if not args.quick else QUICK_SHAPES["extend"]
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for batch, ctx, new in shapes:
        lens = [ctx + new] * batch
        kv_bytes = batch * (ctx + new) * 2 * args.kv_heads * args.head_dim * elem
        q_bytes = batch * new * args.heads * args.head_dim * elem
        rot = rotations(kv_bytes + q_bytes, l2, cap=16)
        kv, tables = paged_pool(torch, rot, lens, args.block_size, args.kv_heads, args.head_dim, dtype, device)
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        qsl = i32([b * new for b in range(batch + 1)])
        ctx_t, seq_t = i32([ctx] * batch), i32(lens)
        qs = [torch.randn(batch * new, args.heads, args.head_dim, device=device, dtype=dtype) for _ in range(rot)]
        out = torch.empty_like(qs[0])
        scale = args.head_dim**-0.5
        timing = timer(
            lambda i: extend_attention(
                qs[i % rot], kv, tables[i % rot], qsl, ctx_t, seq_t, scale, max_query_len=new, out=out
            )
        )
        # Causal FLOPs: query i sees ctx + i + 1 keys; 2 matmuls of 2 * head_dim FLOPs per pair.
        pairs = batch * (new * ctx + new * (new + 1) // 2)
        flops = 4 * pairs * args.heads * args.head_dim
        moved = kv_bytes + 2 * q_bytes
        config = f"B={batch} ctx={ctx} new={new}"
        rows.append(Row.measured("extend", config, timing, moved, bw["device_copy_gbps"], flops=flops))
        kv = tables = qs = None  # frees the pool before the next shape's (no del: a lambda reads them)
    return rows


def _layer_caches(torch, args, num_blocks, dtype, device, pin=False):
    """Layer caches laid out as the worker allocates them (conveyor.worker.kv_cache): on the
    device views of one layer-major tensor, on the host (swap space) of one block-major one."""
    block = (args.block_size, args.kv_heads, args.head_dim)
    if device == "cpu":
        whole = torch.empty((num_blocks, args.layers, 2, *block), dtype=dtype, pin_memory=pin)
        return list(whole.movedim(0, 2).unbind(0))
    return list(torch.randn((args.layers, 2, num_blocks, *block), dtype=dtype, device=device).unbind(0))


def bench_copy_blocks(torch, args, timer, dtype, l2, device, bw) -> list[Row]:
    from conveyor.kernels.block_copy import copy_blocks

    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = 2 * args.block_size * args.kv_heads * args.head_dim * elem
    for n in SHAPES["copy_blocks"] if not args.quick else QUICK_SHAPES["copy_blocks"]:
        num_blocks = max(4 * n, 1024)
        caches = _layer_caches(torch, args, num_blocks, dtype, device)
        perm = torch.randperm(num_blocks, device=device)
        rot = 4
        pairs = [
            torch.stack([perm[(2 * r) * n : (2 * r + 1) * n], perm[(2 * r + 1) * n : (2 * r + 2) * n]], 1)
            .to(torch.int64)
            .contiguous()
            for r in range(rot // 2)
        ]
        timing = timer(lambda i: copy_blocks(caches, pairs[i % len(pairs)]))
        moved = 2 * n * block_bytes * args.layers
        config = f"pairs={n} layers={args.layers}"
        rows.append(Row.measured("copy_blocks", config, timing, moved, bw["device_copy_gbps"]))
        caches = None  # frees them before the next shape's (no del: a lambda reads the name)
    return rows


def bench_swap(torch, args, timer, dtype, l2, device, bw) -> list[Row]:
    from conveyor.kernels.block_copy import swap_blocks

    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = 2 * args.block_size * args.kv_heads * args.head_dim * elem
    for n in SHAPES["swap"] if not args.quick else QUICK_SHAPES["swap"]:
        gpu = _layer_caches(torch, args, 2 * n, dtype, device)
        cpu = _layer_caches(torch, args, 2 * n, dtype, "cpu", pin=True)
        ids = torch.randperm(2 * n)[:n].tolist()
        host_ids = torch.randperm(2 * n)[:n].tolist()
        moved = n * block_bytes * args.layers
        for name, fn, link in (
            ("swap_out", lambda i: swap_blocks(gpu, cpu, ids, host_ids), "d2h_gbps"),
            ("swap_in", lambda i: swap_blocks(cpu, gpu, host_ids, ids), "h2d_gbps"),
        ):
            rows.append(Row.measured(name, f"blocks={n} layers={args.layers}", timer(fn), moved, bw[link]))
        gpu = cpu = None  # frees them before the next shape's (no del: the lambdas read them)
    return rows


BENCHES = {
    "kv_store": bench_kv_store,
    "decode": bench_decode,
    "extend": bench_extend,
    "copy_blocks": bench_copy_blocks,
    "swap": bench_swap,
}


def print_table(rows: list[Row], bw: dict[str, float]) -> None:
    print(
        f"device copy {bw['device_copy_gbps']:.0f} GB/s, H2D {bw['h2d_gbps']:.1f} GB/s, D2H {bw['d2h_gbps']:.1f} GB/s"
    )
    header = (
        f"{'kernel':<12} {'config':<28} {'median us':>10} {'p10':>9} {'p90':>9} "
        f"{'GB/s':>8} {'% peak':>7} {'TFLOP/s':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'':>8}"
        print(
            f"{r.kernel:<12} {r.config:<28} {r.median_us:10.1f} {r.p10_us:9.1f} {r.p90_us:9.1f} "
            f"{r.gbps:8.0f} {r.pct_of_peak:6.1f}% {tf}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in selected if k not in BENCHES]
    if unknown:
        print(f"unknown kernels {unknown}; choose from {list(BENCHES)}", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set; unset it to benchmark compiled kernels", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available():
        print(
            "bench/kernel_timings.py needs a CUDA device, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Run it on a GPU machine; the kernel tests run on CPU "
            "with `TRITON_INTERPRET=1 python -m pytest tests/kernels`.",
            file=sys.stderr,
        )
        return 1
    import triton

    if args.quick:
        args.iters = min(args.iters, 20)
        args.warmup = min(args.warmup, 5)
    if args.heads % args.kv_heads:
        print("--heads must be a multiple of --kv-heads", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    timer = Timer(torch, args.warmup, args.iters)
    torch.manual_seed(0)

    bw = measure_bandwidth(torch, Timer(torch, 3, 10), device)
    rows: list[Row] = []
    for name in selected:
        started = time.perf_counter()
        rows.extend(BENCHES[name](torch, args, timer, dtype, l2, device, bw))
        torch.cuda.empty_cache()
        print(f"[{name}: {time.perf_counter() - started:.1f}s]", file=sys.stderr)
    print_table(rows, bw)

    report = {
        "device": torch.cuda.get_device_name(device),
        "sm_count": props.multi_processor_count,
        "l2_bytes": l2,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "bandwidth_gbps": bw,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
