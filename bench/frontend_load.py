#!/usr/bin/env python3
"""The frontend under load: latency it adds to each streamed token (a script, not a test).

Processes (all ``spawn``ed, all on this host):

- the **real frontend process** (``conveyor.frontend.main.run_frontend``, as bin/serve starts
  it, on the demo tokenizer, with its ServerAddresses in a private run directory);
- a **stand-in scheduler**: PULLs the frontend's AddRequests/AbortRequests and every
  ``--step-ms`` PUSHes one TokenOutputs carrying one new token for every live request (first
  and last tokens as full RequestOutputs, the rest in the ``request_ids``/``token_ids``
  columns, as the real scheduler does). It stamps each step with ``time.monotonic_ns()``
  right before the send, after encoding. The token of step ``s`` is ``TOKEN_BASE + s %
  TOKEN_SPAN``, so every token a client receives names the step that produced it;
- ``--client-procs`` **client processes** holding ``--clients`` DEALER sockets between them
  (one streaming request each, the client protocol of docs/protocol.md); each stamps every
  delta with ``time.monotonic_ns()`` as it takes it off the socket;
- in the ``long`` load, one more client sends a ``--long-chars``-character prompt every
  ``--long-period`` s (one output token each).

The stand-in scheduler and the clients are in bench/frontend_load_procs.py; this script starts
them, runs the phases and reads the figures.

Added frontend latency of a token = client receive time - the stand-in's send time of its
step. CLOCK_MONOTONIC is one clock for all processes of a Linux host, so no offset is
estimated. The first ``--warmup`` s of each phase are dropped. The figure includes the ipc
hops both ways and the client process's own delay in taking the message; to separate the
clients' share the same phases run with fewer clients (``--clients 1000,100``), and the
frontend's own ``handle_outputs`` (one scheduler message, every stream's token: detokenize,
stop strings, send) and ``event_loop_lag`` come from its profile, fetched at each phase's end.

Each ``--modes`` entry restarts the frontend: ``inline`` tokenizes every prompt on the event
loop (FrontendConfig.tokenizer_threads=0: the behaviour before the tokenizer pool), ``pool``
with the default pool. Each mode runs the ``steady`` and ``long`` loads for each client count
and step interval. Results and how to read them: docs/benchmarks.md, "Frontend under load".

    python bench/frontend_load.py          # 1000, 100, 10 clients x 20, 50 ms steps, inline vs pool (~7 min)
    python bench/frontend_load.py --clients 1000 --step-ms 20 --loads long --json /tmp/out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq
from frontend_load_procs import (  # bench/ is this script's directory
    TOKEN_BASE,
    TOKEN_SPAN,
    client_proc,
    long_prompt_client,
    standin_scheduler,
)

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import ProcessReady, Shutdown
from conveyor.ipc.transport import ServerAddresses

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "bench" / "results" / "frontend-load.json"
VOCAB_SIZE = 4096
MAX_MODEL_LEN = 1 << 22  # so the long prompts are admitted, not refused after tokenizing


# ---------------------------------------------------------------------- orchestration


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _percentiles(values_ms: np.ndarray) -> dict[str, float]:
    if len(values_ms) == 0:
        return {}
    p = np.percentile(values_ms, [50, 90, 99, 99.9])
    return {
        "count": int(len(values_ms)),
        "p50": round(float(p[0]), 3),
        "p90": round(float(p[1]), 3),
        "p99": round(float(p[2]), 3),
        "p99.9": round(float(p[3]), 3),
        "max": round(float(values_ms.max()), 3),
        "mean": round(float(values_ms.mean()), 3),
    }


def _latencies(
    tokens: np.ndarray, stamps: np.ndarray, send_ns: np.ndarray, after_ns: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Receive time minus the send time of the step each token came from (ms), for every
    token, and per step for its first and its last token to arrive."""
    keep = stamps >= after_ns
    tokens, stamps = tokens[keep], stamps[keep]
    residue = tokens - TOKEN_BASE
    if len(residue) and (residue.min() < 0 or residue.max() >= TOKEN_SPAN):
        raise RuntimeError("a token that no step of the stand-in sent")
    last = np.searchsorted(send_ns, stamps, side="right") - 1  # the newest step sent before the receipt
    step = last - np.mod(last - residue, TOKEN_SPAN)
    if len(step) and step.min() < 0:
        raise RuntimeError("a token received before its step was sent")
    lat = (stamps - send_ns[step]) / 1e6
    if not len(lat):
        return lat, lat, lat
    order = np.lexsort((lat, step))
    step_sorted, lat_sorted = step[order], lat[order]
    starts = np.flatnonzero(np.r_[True, step_sorted[1:] != step_sorted[:-1]])
    ends = np.r_[starts[1:], len(step_sorted)] - 1
    return lat, lat_sorted[starts], lat_sorted[ends]


class Harness:
    """One frontend (in the given mode) with its stand-in scheduler and client processes."""

    def __init__(self, args: argparse.Namespace, mode: str, num_clients: int, step_ms: float) -> None:
        from conveyor.frontend.main import run_frontend
        from conveyor.runtime.config import FrontendConfig

        self.mp = mp.get_context("spawn")
        self.run_dir = transport.make_run_dir()
        self.addrs = ServerAddresses.in_run_dir(self.run_dir, f"ipc://{self.run_dir}/client")
        self.ctx = zmq.Context()
        self.control = transport.socket(self.ctx, zmq.PULL, self.addrs.control, bind=True)
        self.frontend_control = transport.socket(self.ctx, zmq.PUSH, self.addrs.frontend_control, bind=False)
        extra = {"tokenizer_threads": 0} if mode == "inline" else {}
        config = FrontendConfig(
            str(TOKENIZER_DIR), self.addrs, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE, **extra
        )
        self.frontend = self.mp.Process(target=run_frontend, args=(config,), name="conveyor-frontend")
        self.frontend.start()
        if not self.control.poll(120_000):
            raise RuntimeError("the frontend did not start")
        ready = codec.decode(self.control.recv())
        if not isinstance(ready, ProcessReady):
            raise RuntimeError(f"the frontend failed: {ready}")
        self.sched_conn, child = self.mp.Pipe()
        self.sched = self.mp.Process(target=standin_scheduler, args=(self.addrs, step_ms, child))
        self.sched.start()
        self.clients = []
        share = [
            num_clients // args.client_procs + (i < num_clients % args.client_procs) for i in range(args.client_procs)
        ]
        for n in share:
            if n:
                conn, child = self.mp.Pipe()
                proc = self.mp.Process(target=client_proc, args=(self.addrs.client, n, child))
                proc.start()
                self.clients.append((proc, conn))
        for _, conn in self.clients:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("a client process did not start")
        time.sleep(1.0)  # let every connection's handshake finish

    def profile(self, window_s: float) -> dict:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.addrs.client)
        s.send(msgpack.packb({"type": "profile", "v": 1, "window_s": window_s}))
        try:
            if not s.poll(15_000):
                return {}
            reply = msgpack.unpackb(s.recv())
        finally:
            s.close(linger=0)
        own = reply["processes"][0]
        keep = ("handle_outputs", "event_loop_lag", "tokenize", "detokenize", "client_send", "request_itl")
        return {
            "metrics": {k: v for k, v in own["metrics"].items() if k in keep},
            "counters": own.get("counters", {}),
        }

    def _cpu(self) -> dict[str, int]:
        return {
            "frontend": _cpu_ticks(self.frontend.pid),
            "standin_scheduler": _cpu_ticks(self.sched.pid),
            "clients": sum(_cpu_ticks(p.pid) for p, _ in self.clients),
        }

    def phase(self, args: argparse.Namespace, tag: str, long: bool) -> dict:
        cpu0 = self._cpu()
        load0 = list(os.getloadavg())
        t0 = time.monotonic_ns()
        for _, conn in self.clients:
            conn.send(("run", tag, args.duration))
        long_conn = None
        if long:
            long_conn, child = self.mp.Pipe()
            lp = self.mp.Process(
                target=long_prompt_client,
                args=(self.addrs.client, args.long_chars, args.long_period, args.duration - 1.0, child),
            )
            lp.start()
        results = [conn.recv() for _, conn in self.clients]
        wall = (time.monotonic_ns() - t0) / 1e9
        cpu = {k: round((v - cpu0[k]) / os.sysconf("SC_CLK_TCK") / wall, 3) for k, v in self._cpu().items()}
        long_info = None
        if long_conn is not None:
            long_info = long_conn.recv()
            lp.join(10)
            ttf = np.array(long_info.pop("time_to_final_ms"))
            long_info["time_to_final_ms"] = _percentiles(ttf)
        self.sched_conn.send("log")
        send_raw, steps_raw = self.sched_conn.recv()
        send_ns = np.frombuffer(send_raw, dtype=np.int64)
        tokens = np.concatenate([np.frombuffer(r[0], dtype=np.int32) for r in results]).astype(np.int64)
        stamps = np.concatenate([np.frombuffer(r[1], dtype=np.int64) for r in results])
        lat, head, tail = _latencies(tokens, stamps, send_ns, t0 + int(args.warmup * 1e9))
        in_window = send_ns[(send_ns >= t0) & (send_ns < t0 + int(args.duration * 1e9))]
        gaps = np.diff(in_window) / 1e6 if len(in_window) > 1 else np.array([])
        errors = [e for r in results for e in r[2]]
        return {
            "latency_ms": _percentiles(lat),
            "step_first_token_ms": _percentiles(head),  # per step: its earliest delivery
            "step_last_token_ms": _percentiles(tail),  # per step: its latest delivery
            "load_average": [load0, list(os.getloadavg())],
            "tokens_received": int(len(tokens)),
            "steps_sent": int(len(in_window)),
            "step_interval_ms": _percentiles(gaps),
            "cpu_fraction": cpu,  # CPU seconds per second of the phase (abort and drain included)
            "finals_after_abort": sum(r[3] for r in results),
            "client_errors": errors[:5],
            "long_prompts": long_info,
            "frontend_profile": self.profile(args.duration),
        }

    def close(self) -> None:
        for _, conn in self.clients:
            conn.send(("stop",))
        for proc, _ in self.clients:
            proc.join(10)
        self.sched_conn.send("stop")
        self.sched.join(10)
        transport.send(self.frontend_control, Shutdown("benchmark done"))
        self.frontend.join(10)
        for proc in (self.frontend, self.sched, *(p for p, _ in self.clients)):
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.control.close(linger=0)
        self.frontend_control.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def environment() -> dict:
    from conveyor_tools.bench.report import environment as bench_environment

    env = bench_environment("cpu")
    env["machine"]["nproc"] = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or 0)
    env["versions"].update(
        {name: _version(name) for name in ("tokenizers", "uvloop", "msgpack")},
        implementation=platform.python_implementation(),
    )
    return env


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def print_row(mode: str, clients: int, step_ms: float, load: str, r: dict) -> None:
    lat = r["latency_ms"]
    prof = r["frontend_profile"].get("metrics", {})
    ho = prof.get("handle_outputs", {})
    lag = prof.get("event_loop_lag", {})
    print(
        f"{mode:7s} {clients:6d} {step_ms:5g} {load:7s} "
        f"{lat.get('p50', float('nan')):8.2f} {lat.get('p90', float('nan')):8.2f} "
        f"{lat.get('p99', float('nan')):8.2f} {lat.get('max', float('nan')):9.2f}   "
        f"{ho.get('p50', float('nan')):7.2f} {ho.get('p99', float('nan')):7.2f}   "
        f"{lag.get('p99', float('nan')):7.2f} {lag.get('max', float('nan')):8.2f}   "
        f"{r['cpu_fraction']['frontend']:5.2f} {r['cpu_fraction']['clients']:5.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1000,100,10", help="comma-separated numbers of concurrent streams")
    p.add_argument("--modes", default="inline,pool", help="inline (tokenizer_threads=0) and/or pool (the default)")
    p.add_argument("--loads", default="steady,long", help="steady: streams only; long: + one long prompt per period")
    p.add_argument("--client-procs", type=int, default=2, help="client processes sharing the sockets")
    p.add_argument("--step-ms", default="20,50", help="comma-separated stand-in scheduler step intervals (ms)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds per phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds dropped at the start of each phase")
    p.add_argument("--long-chars", type=int, default=200_000, help="characters of each long prompt")
    p.add_argument("--long-period", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the raw results ('' for nowhere)")
    args = p.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    loads = args.loads.split(",")
    env = environment()
    print(
        f"nproc {env['machine']['nproc']}, python {env['versions']['python']}, "
        f"load average {env['machine']['load_average_at_start']}",
        flush=True,
    )
    print(
        "mode    clients  step load    lat p50  lat p90  lat p99   lat max   "
        "ho p50  ho p99   lag p99  lag max   cpu: fe  clients"
    )
    runs = []
    for n in clients:
        for step_ms in [float(x) for x in args.step_ms.split(",")]:
            for mode in modes:
                harness = Harness(args, mode, n, step_ms)
                try:
                    for load in loads:
                        r = harness.phase(args, f"{mode}-{n}-{load}", long=load == "long")
                        r.update(mode=mode, clients=n, step_ms=step_ms, load=load)
                        runs.append(r)
                        print_row(mode, n, step_ms, load, r)
                finally:
                    harness.close()
    env["machine"]["load_average_at_end"] = list(os.getloadavg())
    out = {
        "benchmark": "frontend_load",
        "command": "python bench/frontend_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "environment": env,
        "units": "latency_ms: client receive - stand-in send of the step (ms); frontend_profile: the frontend's "
        "own profile",
        "runs": runs,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
