#!/usr/bin/env python3
"""The frontend's output path alone: CPU per streamed token for one step of N streams.

A microbenchmark (a script, not a test) of ``SchedulerSide.on_token_outputs``, the handler of one
scheduler TokenOutputs message: N tracked streaming requests (the demo tokenizer, a short
prompt), one token each per step in the message's columns, as the real scheduler sends them
(the first step's tokens as RequestOutputs with timing fields, the last step's as finishes).
Each step's message goes through the codec first (untimed), then the handler runs
synchronously and its wall, thread-CPU and process-CPU time (the latter includes ZeroMQ's I/O
thread while the handler runs) are taken; the summary is per token over the column steps.
Deltas go out on the frontend's real ROUTER socket to N DEALER clients in a second process,
which drains them and at the end hands back a digest of every delta (its text and ids, in
order) and every final, per request: the digest must be identical before and after a change
to the output path (run this script with ``PYTHONPATH`` pointing at a directory whose
``conveyor`` is another tree to compare the two).

Each stream outputs its own token sequence: a multilingual text (accents, CJK, emoji, so some
tokens are parts of a character) encoded by the demo tokenizer, each stream starting at its
own offset. ``--stop`` gives every request three stop strings (one of them occurs in the text,
so streams stop along the way and leave; the rest go on). ``--merge K`` hands K column steps to
one call, as the frontend does with steps that queued up while it was busy.

    python bench/frontend_step.py                         # 1000 streams, 200 steps
    python bench/frontend_step.py --stop --steps 100
    python bench/frontend_step.py --merge 4               # 4 steps per call: the catch-up path
    python bench/frontend_step.py --profile               # cProfile of the handler, top functions
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import io
import json
import multiprocessing as mp
import pstats
import shutil
import statistics
import sys
import time
import uuid

import msgpack
import zmq
from frontend_load_procs import dealer_sockets, waiting_messages  # bench/ is this script's directory
from harness import write_report

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import RequestOutput, TokenOutputs
from conveyor.ipc.transport import ServerAddresses

TEXT = (
    "The lighthouse keeper wrote in his log every night: the sea was calm, the café was closed, "
    "and the naïve tourists from München asked about the Straße to 東京 and 你好 again 😀. "
    "def serve(tokens: list[int]) -> str:\n    return ''.join(map(chr, tokens))  # 3.14159 \n"
    "Crème brûlée, déjà vu, 日本語のテキスト, 한국어, emoji 🎉 👍 🚀 and a family 👨‍👩‍👧 🇫🇷. "
)
PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
STOP = ["lighthouse keeper", "\n\n", "ZZZ never"]


def drain_clients(address: str, identities: list[bytes], conn) -> None:
    """DEALER clients that take every message off their sockets; report per-request results."""
    ctx = zmq.Context()
    socks, poller = dealer_sockets(ctx, address, identities)
    conn.send("ready")
    deltas: dict[str, list] = {}
    finals: dict[str, list] = {}
    messages = 0
    stop_at = None
    while True:
        if stop_at is None and conn.poll():
            stop_at = conn.recv()  # the number of finals to wait for
        if stop_at is not None and len(finals) >= stop_at:
            break
        for data in waiting_messages(poller, 50):
            msg = msgpack.unpackb(data)
            messages += 1
            rid = msg["request_id"]
            if msg["type"] == "delta":
                acc = deltas.setdefault(rid, [[], []])
                acc[0].append(msg["text"])  # each delta's text: the digest covers how the text was split
                acc[1].extend(msg["token_ids"])
            else:
                finals[rid] = [msg["text"], msg["token_ids"], msg["finish_reason"]]
    digest = hashlib.sha256(json.dumps([deltas, finals], sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    consistent = all(
        "".join(deltas.get(r, [[], []])[0]) == f[0] and deltas.get(r, [[], []])[1] == f[1] for r, f in finals.items()
    )
    conn.send({"messages": messages, "finals": len(finals), "digest": digest, "deltas_add_up": consistent})
    for s in socks:
        s.close(linger=0)
    ctx.term()


async def run(args: argparse.Namespace) -> dict:
    from conveyor.frontend.detokenizer import IncrementalDetokenizer
    from conveyor.frontend.request_state import RequestState
    from conveyor.frontend.server import Frontend
    from conveyor.frontend.stop import StopStringMatcher
    from conveyor.frontend.tokenizer import Tokenizer
    from conveyor.runtime.config import FrontendConfig

    tok = Tokenizer.from_dir(TOKENIZER_DIR)
    run_dir = transport.make_run_dir()
    addrs = ServerAddresses.in_run_dir(run_dir, f"ipc://{run_dir}/client")
    config = FrontendConfig(str(TOKENIZER_DIR), addrs, max_model_len=1 << 20, vocab_size=tok.vocab_size)
    fe = Frontend(config, tok)
    sink_ctx = zmq.Context()
    sink = sink_ctx.socket(zmq.PULL)  # takes the AbortRequests of streams that hit a stop string
    sink.bind(addrs.to_scheduler)

    n = args.streams
    identities = [uuid.uuid4().bytes for _ in range(n)]
    conn, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=drain_clients, args=(addrs.client, identities, child))
    proc.start()
    assert conn.poll(120) and conn.recv() == "ready"
    time.sleep(1.0 + n / 1000)  # every handshake done: the ROUTER knows each identity

    text_ids = tok.encode(TEXT * 8, add_special_tokens=False)
    prompt_ids = tok.encode(PROMPT)
    rids = [f"req-{i}" for i in range(n)]
    offsets = [(i * 37) % len(text_ids) for i in range(n)]
    for rid, ident in zip(rids, identities):
        fe.requests[rid] = RequestState(
            request_id=rid,
            identity=ident,
            stream=True,
            prompt_len=len(prompt_ids),
            arrival_time=time.time(),
            detokenizer=IncrementalDetokenizer(tok, prompt_ids),
            stop=StopStringMatcher(STOP if args.stop else []),
            prompt_ids=list(prompt_ids),
        )

    def step_message(s: int) -> TokenOutputs:
        live = [i for i, rid in enumerate(rids) if rid in fe.requests]
        toks = [text_ids[(offsets[i] + s) % len(text_ids)] for i in live]
        if s == 0:  # first tokens: full outputs with timing fields
            now = time.time()
            msg = TokenOutputs(
                [RequestOutput(rids[i], [t], scheduled_time=now, first_token_time=now) for i, t in zip(live, toks)]
            )
        elif s == args.steps - 1:  # last: every remaining request finishes
            msg = TokenOutputs([RequestOutput(rids[i], [t], finish_reason="length") for i, t in zip(live, toks)])
        else:
            msg = TokenOutputs([], [rids[i] for i in live], toks)
        return codec.decode(codec.encode(msg))

    wall, cpu, pcpu, tokens = [], [], [], []
    prof = cProfile.Profile() if args.profile else None
    s = 0
    while s < args.steps:
        # --merge K: K column steps handed over at once, as when the frontend fell behind
        k = 1 if s in (0, args.steps - 1) else min(args.merge, args.steps - 1 - s)
        msgs = [step_message(s + j) for j in range(k)]
        s += len(msgs)
        count = sum(len(m.outputs) + len(m.request_ids) for m in msgs)
        if prof is not None:
            prof.enable()
        p0, c0, w0 = time.process_time_ns(), time.thread_time_ns(), time.perf_counter_ns()
        fe.scheduler_side.on_token_outputs(msgs)
        w1, c1, p1 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
        if prof is not None:
            prof.disable()
        wall.append((w1 - w0) / 1e3)
        cpu.append((c1 - c0) / 1e3)
        pcpu.append((p1 - p0) / 1e3)
        tokens.append(count)
        if args.pause_ms:
            await asyncio.sleep(args.pause_ms / 1e3)

    conn.send(n)
    if not conn.poll(60):
        raise RuntimeError("the clients did not get every final")
    clients = conn.recv()
    proc.join(10)
    snap = fe.profiler.snapshot(3600)
    timers = {m.name: m for m in snap.metrics if m.name in ("detokenize", "client_send", "handle_outputs")}
    fe.close()
    sink.close(linger=0)
    sink_ctx.term()
    shutil.rmtree(run_dir, ignore_errors=True)

    steady = slice(1, len(wall) - 1)  # the column steps: neither first nor last tokens
    per_tok_wall = [w / max(1, t) for w, t in zip(wall[steady], tokens[steady])]
    per_tok_cpu = [c / max(1, t) for c, t in zip(cpu[steady], tokens[steady])]
    result = {
        "streams": n,
        "steps": args.steps,
        "stop_strings": args.stop,
        "merged_steps": args.merge,
        "step_ms_p50": round(statistics.median(wall[steady]) / 1e3, 3),
        "step_cpu_ms_p50": round(statistics.median(cpu[steady]) / 1e3, 3),
        "us_per_token_wall_p50": round(statistics.median(per_tok_wall), 2),
        "us_per_token_cpu_p50": round(statistics.median(per_tok_cpu), 2),
        "us_per_token_cpu_mean": round(sum(cpu[steady]) / max(1, sum(tokens[steady])), 2),
        # the whole frontend process (ZeroMQ's I/O thread included) during the handler only
        "us_per_token_process_cpu_p50": round(
            statistics.median(p / max(1, t) for p, t in zip(pcpu[steady], tokens[steady])), 2
        ),
        "first_step_ms": round(wall[0] / 1e3, 3),
        "last_step_ms": round(wall[-1] / 1e3, 3),
        "profile_timers_mean_us": {k: round(m.mean * 1e3, 2) for k, m in timers.items()},
        "clients": clients,
    }
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile_top)
        result["cprofile"] = out.getvalue()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stop", action="store_true", help="give every request stop strings")
    p.add_argument("--merge", type=int, default=1, help="column steps per handler call (a frontend behind merges them)")
    p.add_argument("--pause-ms", type=float, default=2.0, help="sleep between steps (lets the clients drain)")
    p.add_argument("--profile", action="store_true", help="cProfile the handler and print the top functions")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--json", default="", help="also write the result here")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    cprof = result.pop("cprofile", None)
    print(json.dumps(result, indent=1))
    if cprof:
        print(cprof)
    write_report(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
