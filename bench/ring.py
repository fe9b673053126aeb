#!/usr/bin/env python3
"""Round-trip latency of the shared-memory ring vs ZeroMQ ipc PUSH/PULL (a script, not a test).

One round trip: this process sends a payload, a ``spawn``ed echo process receives it and
sends it back, this process receives the echo. The ring case uses two rings (one each way);
the echo writes the payload straight from the incoming slot into the outgoing one (one copy),
and this process reads the echo in place (``view``/``advance``). The ZeroMQ case uses a
PUSH/PULL pair each way over ``ipc://`` with ``copy=False`` frames, as ipc/transport.py
does. Times are wall-clock per round trip, p50/p99 over ``--iters`` after a warm-up.

The reader's spin budget decides most of the ring's latency: with spinning, a reader that is
already waiting sees the message within a few hundred ns; with ``spin_us=0`` every hop
sleeps in poll() and pays a FIFO wake-up. Spinning needs a core per spinning process: on a
machine with fewer free cores than spinning processes the spinner steals the core the peer
needs, which shows as a worse p99, not a better one.

    python bench/ring.py                                  # 200 B, 8 KiB, 64 KiB; spin 20 us and 0
    python bench/ring.py --sizes 200 --iters 50000 --spin-us 0 20 200
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import zmq

from conveyor.ipc import shm_ring
from conveyor.ipc.shm_ring import RingClosed, RingReader, RingWriter

STOP = b"stop"


def ring_echo(ping_path: str, pong_path: str, spin_us: float) -> None:
    reader = RingReader(ping_path, spin_us=spin_us)
    writer = RingWriter(pong_path, spin_us=spin_us)
    try:
        while True:
            try:
                view = reader.view(timeout=None)
            except RingClosed:
                return
            writer.send(view)
            reader.advance()
    finally:
        writer.close()
        reader.close()


def zmq_echo(ping_addr: str, pong_addr: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(ping_addr)
    push.connect(pong_addr)
    try:
        while True:
            frame = pull.recv(copy=False)
            if len(frame) == len(STOP) and frame.bytes == STOP:
                return
            push.send(frame, copy=False)
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def percentiles(samples_ns: list[int]) -> tuple[float, float, float]:
    ordered = sorted(samples_ns)
    p50 = ordered[len(ordered) // 2] / 1e3
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3
    return p50, p99, statistics.fmean(ordered) / 1e3


def round_trips(hop: Callable[[bytes], None], size: int, iters: int, warmup: int) -> list[int]:
    """Nanoseconds of each of ``iters`` round trips of a random ``size``-byte payload through
    ``hop`` (send, then wait for the echo), after ``warmup`` untimed ones."""
    payload = os.urandom(size)
    samples = []
    clock = time.perf_counter_ns
    for i in range(warmup + iters):
        start = clock()
        hop(payload)
        end = clock()
        if i >= warmup:
            samples.append(end - start)
    return samples


def bench_ring(run_dir: str, size: int, iters: int, warmup: int, spin_us: float) -> list[int]:
    ping_path = os.path.join(run_dir, f"ping-{size}-{spin_us}")
    pong_path = os.path.join(run_dir, f"pong-{size}-{spin_us}")
    slot = max(size, 64)
    shm_ring.create_ring(ping_path, slot_bytes=slot, num_slots=8)
    shm_ring.create_ring(pong_path, slot_bytes=slot, num_slots=8)
    writer = RingWriter(ping_path, spin_us=spin_us)
    reader = RingReader(pong_path, spin_us=spin_us)
    echo = mp.get_context("spawn").Process(target=ring_echo, args=(ping_path, pong_path, spin_us))
    echo.start()

    def hop(payload: bytes) -> None:
        writer.send(payload)
        view = reader.view(timeout=10)
        reader.advance()
        if view is None:
            raise RuntimeError("echo timed out")

    try:
        return round_trips(hop, size, iters, warmup)
    finally:
        writer.close()
        echo.join(10)
        reader.close()
        shm_ring.unlink_ring(ping_path)
        shm_ring.unlink_ring(pong_path)


def bench_zmq(run_dir: str, size: int, iters: int, warmup: int) -> list[int]:
    ping_addr = f"ipc://{os.path.join(run_dir, f'zping-{size}')}"
    pong_addr = f"ipc://{os.path.join(run_dir, f'zpong-{size}')}"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind(pong_addr)
    push.connect(ping_addr)
    echo = mp.get_context("spawn").Process(target=zmq_echo, args=(ping_addr, pong_addr))
    echo.start()

    def hop(payload: bytes) -> None:
        push.send(payload, copy=False)
        pull.recv(copy=False)

    try:
        samples = round_trips(hop, size, iters, warmup)
        push.send(STOP)
        echo.join(10)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 8192, 65536])
    parser.add_argument("--iters", type=int, default=20000, help="round trips per row (64 KiB rows: a quarter)")
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--spin-us", type=float, nargs="+", default=[20.0, 0.0], help="reader spin budgets to try")
    parser.add_argument("--no-zmq", action="store_true")
    args = parser.parse_args()

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    run_dir = tempfile.mkdtemp(prefix="conveyor-bench-", dir=base)
    cpus = os.cpu_count()
    print(f"# {cpus} CPUs; round trip: this process -> echo process -> this process; times in us", file=sys.stderr)
    print(f"{'transport':<22} {'payload':>8} {'p50':>8} {'p99':>8} {'mean':>8} {'iters':>7}")
    try:
        for size in args.sizes:
            iters = args.iters if size < 65536 else max(1000, args.iters // 4)
            rows = [
                (f"ring spin={s:g}us", lambda s=s: bench_ring(run_dir, size, iters, args.warmup, s))
                for s in args.spin_us
            ]
            if not args.no_zmq:
                rows.append(("zmq ipc push/pull", lambda: bench_zmq(run_dir, size, iters, args.warmup)))
            for name, run in rows:
                p50, p99, mean = percentiles(run())
                print(f"{name:<22} {size:>8} {p50:>8.1f} {p99:>8.1f} {mean:>8.1f} {iters:>7}", flush=True)
    finally:
        for name in os.listdir(run_dir):
            os.unlink(os.path.join(run_dir, name))
        os.rmdir(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
