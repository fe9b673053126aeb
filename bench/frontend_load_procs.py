"""The processes bench/frontend_load.py runs beside the real frontend: the stand-in scheduler,
which every ``step_ms`` sends one token for every live request and logs when it sent each
step, and the streaming clients, which stamp every token as they take it off the socket (one
streaming request per DEALER socket; one long prompt client). A token names the step that
produced it (``TOKEN_BASE + step % TOKEN_SPAN``), which is how the script matches a receipt to
its step's send time. bench/frontend_step.py reuses the clients' socket helpers.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from array import array
from collections.abc import Iterator

import msgpack
import zmq

from conveyor.ipc import codec, transport
from conveyor.ipc.messages import (
    AbortRequests,
    AddRequest,
    ProfileQuery,
    ProfileReport,
    RequestOutput,
    SchedulerStats,
    StatsQuery,
    TokenOutputs,
)
from conveyor.ipc.transport import ServerAddresses

TOKEN_BASE = 256  # ordinary tokens of the demo vocabulary (4096): no specials, no single bytes
TOKEN_SPAN = 2048  # steps are told apart modulo this: 41 s at 20 ms
VOCAB_SIZE = 4096
MAX_MODEL_LEN = 1 << 22  # so the long prompts are admitted, not refused after tokenizing
STREAM_MAX_TOKENS = 1 << 20
SHORT_PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
WORDS = (
    "the quick brown fox jumps over lazy dog serving tokens batch scheduler latency stream "
    "café naïve über straße 東京 你好 😀 12345 3.14159 hello world return value function"
).split()


# ---------------------------------------------------------------------- stand-in scheduler


def standin_scheduler(addrs: ServerAddresses, step_ms: float, conn) -> None:
    """PULL from the frontend; every ``step_ms`` PUSH one token for every live request."""
    ctx = zmq.Context()
    pull = transport.socket(ctx, zmq.PULL, addrs.to_scheduler, bind=True)
    push = transport.socket(ctx, zmq.PUSH, addrs.to_frontend, bind=False)
    live: dict[str, int] = {}  # request id -> tokens still to send
    fresh: set[str] = set()  # admitted, no token yet
    send_ns = array("q")  # step -> CLOCK_MONOTONIC ns of its send
    step_tokens = array("i")  # step -> tokens in it
    interval = int(step_ms * 1e6)
    next_step = time.monotonic_ns() + interval
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    running = True
    while running:
        if conn.poll():
            cmd = conn.recv()
            if cmd == "log":  # hand over the step log so far
                conn.send((send_ns.tobytes(), step_tokens.tobytes()))
            elif cmd == "stop":
                running = False
        wait_ms = max(0, (next_step - time.monotonic_ns()) // 1_000_000)
        if poller.poll(min(wait_ms, 50)):
            while True:
                try:
                    msg = codec.decode(pull.recv(zmq.NOBLOCK, copy=False).buffer)
                except zmq.Again:
                    break
                if isinstance(msg, AddRequest):
                    live[msg.request_id] = msg.sampling.max_tokens
                    fresh.add(msg.request_id)
                elif isinstance(msg, AbortRequests):
                    for rid in msg.request_ids:
                        live.pop(rid, None)
                        fresh.discard(rid)
                elif isinstance(msg, ProfileQuery):  # the frontend's snapshot is all we report
                    transport.send(push, ProfileReport(msg.query_id, []))
                elif isinstance(msg, StatsQuery):
                    transport.send(push, SchedulerStats(msg.query_id, 0, 0, 0, len(live), 0, len(send_ns), 0))
        if time.monotonic_ns() < next_step:
            continue
        step = len(send_ns)
        token = TOKEN_BASE + step % TOKEN_SPAN
        outputs, rids = [], []
        now = time.time()
        for rid, left in list(live.items()):
            if rid in fresh or left <= 1:
                first = rid in fresh
                fresh.discard(rid)
                done = left <= 1
                outputs.append(
                    RequestOutput(
                        rid,
                        [token],
                        finish_reason="length" if done else None,
                        scheduled_time=now if first else None,
                        first_token_time=now if first else None,
                    )
                )
                if done:
                    del live[rid]
                else:
                    live[rid] = left - 1
            else:
                rids.append(rid)
                live[rid] = left - 1
        data = codec.encode(TokenOutputs(outputs, rids, [token] * len(rids)))
        send_ns.append(time.monotonic_ns())
        push.send(data, copy=False)
        step_tokens.append(len(outputs) + len(rids))
        next_step += interval
        if next_step < time.monotonic_ns():  # fell behind (a long AddRequest to decode): no burst
            next_step = time.monotonic_ns() + interval
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()


# ---------------------------------------------------------------------- clients


def _generate(rid: str, prompt: str, max_tokens: int) -> bytes:
    return msgpack.packb(
        {
            "type": "generate",
            "v": 1,
            "request_id": rid,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
    )


def dealer_sockets(ctx: zmq.Context, address: str, identities: list[bytes]) -> tuple[list[zmq.Socket], zmq.Poller]:
    """One connected DEALER socket per routing identity (no receive limit), and a poller over them."""
    socks = []
    poller = zmq.Poller()
    for ident in identities:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, ident)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(address)
        socks.append(s)
        poller.register(s, zmq.POLLIN)
    return socks, poller


def waiting_messages(poller: zmq.Poller, timeout_ms: int) -> Iterator[bytes]:
    """Every message waiting on the sockets ``poller`` finds readable within ``timeout_ms``,
    each socket drained without blocking before the next: a client's receive loop."""
    for s, _ in poller.poll(timeout_ms):
        while True:
            try:
                yield s.recv(zmq.NOBLOCK)
            except zmq.Again:
                break


def client_proc(address: str, num_sockets: int, conn) -> None:
    """``num_sockets`` streaming clients, one DEALER socket and one request each per phase."""
    ctx = zmq.Context()
    socks, poller = dealer_sockets(ctx, address, [uuid.uuid4().bytes for _ in range(num_sockets)])
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, tag, duration_s = cmd
        rids = [f"{tag}-{os.getpid()}-{i}" for i in range(len(socks))]
        for s, rid in zip(socks, rids):
            s.send(_generate(rid, SHORT_PROMPT, STREAM_MAX_TOKENS))
        tokens, stamps = array("i"), array("q")
        errors: list[str] = []
        end = time.monotonic_ns() + int(duration_s * 1e9)
        while (now := time.monotonic_ns()) < end:
            for data in waiting_messages(poller, max(1, (end - now) // 1_000_000)):
                t = time.monotonic_ns()
                msg = msgpack.unpackb(data)
                if msg["type"] == "delta":
                    for tok in msg["token_ids"]:
                        tokens.append(tok)
                        stamps.append(t)
                elif msg.get("finish_reason") == "error" or msg["type"] == "error":
                    errors.append(str(msg.get("error") or msg.get("message")))
        for s, rid in zip(socks, rids):
            s.send(msgpack.packb({"type": "abort", "v": 1, "request_id": rid}))
        finals, deadline = 0, time.monotonic() + 30
        while finals < len(socks) - len(errors) and time.monotonic() < deadline:
            for data in waiting_messages(poller, 1000):
                finals += msgpack.unpackb(data)["type"] == "final"
        conn.send((tokens.tobytes(), stamps.tobytes(), errors, finals))
    for s in socks:
        s.close(linger=0)
    ctx.term()


def long_prompt_client(address: str, chars: int, period_s: float, duration_s: float, conn) -> None:
    """Every ``period_s``, a ``chars``-character prompt for one token; reports each one's time to final."""
    rng = random.Random(1)
    prompt = " ".join(rng.choice(WORDS) for _ in range(chars // 3))[:chars]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    sent: dict[str, int] = {}
    done: list[float] = []
    errors: list[str] = []
    start = time.monotonic()
    k = 0
    while time.monotonic() < start + duration_s or (sent and time.monotonic() < start + duration_s + 10):
        if time.monotonic() >= start + k * period_s and time.monotonic() < start + duration_s:
            rid = f"long-{uuid.uuid4().hex[:8]}"
            sent[rid] = time.monotonic_ns()
            s.send(_generate(rid, prompt, 1))
            k += 1
        if s.poll(10):
            msg = msgpack.unpackb(s.recv())
            if msg["type"] == "final":
                t0 = sent.pop(msg["request_id"], None)
                if msg["finish_reason"] == "error":
                    errors.append(str(msg.get("error")))
                elif t0 is not None:
                    done.append((time.monotonic_ns() - t0) / 1e6)
    s.close(linger=0)
    ctx.term()
    conn.send({"sent": k, "completed": len(done), "time_to_final_ms": done, "errors": errors[:5]})
