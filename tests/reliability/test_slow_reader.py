"""docs/reliability.md, "Faults": a client that stops reading. Its connection's send queue is
bounded (``--client-send-queue`` replies, conveyor.ipc.transport.CLIENT_SEND_QUEUE by
default): once its own receive queue and the socket buffers are full, the server's sends to it
fill that queue, the next one fails (EAGAIN) and the frontend drops the connection's requests
as if it had disconnected, freeing their KV blocks, and counts it (``clients_not_reading``).
Meanwhile other clients are served with their usual latency and the frontend's memory stays
flat.

The slow client is a raw DEALER with a receive queue of one message (and a small kernel
receive buffer) that sends a few long greedy streams (ignore_eos, thousands of tokens: far
longer than the test waits, so only the drop can end them within its bound) and never reads.
With the drop on EAGAIN switched off (the reply dropped, the requests left running) the test
fails on DROP_BOUND_S: the streams run on to their end (4,000 tokens, over 10 s on this CPU)."""

from __future__ import annotations

import time

import msgpack
import zmq

from conveyor.client import Client
from tests.e2e.serve_harness import LONG_MAX_TOKENS, LONG_MODEL_LEN, long_context_copy
from tests.reliability.test_memory import rss_mb

NUM_STREAMS = 3
SEND_QUEUE = 32  # replies queued for one connection: small, so the test's client fills it soon
# A KV pool that holds every stream whole (no preemption slows them down).
SERVE_ARGS = (
    "--max-model-len",
    str(LONG_MODEL_LEN),
    "--num-kv-blocks",
    str(NUM_STREAMS * LONG_MODEL_LEN // 16 + 64),
    "--block-size",
    "16",
    "--threads",
    "1",
    "--client-send-queue",
    str(SEND_QUEUE),
)
# Stall -> every request of the slow client aborted and its KV blocks free: the sends that
# fill what the kernel buffers for a client that never reads (tens of KB) and then SEND_QUEUE
# replies, at ~1,000 deltas a second. Measured 0.5-1.3 s on this shared 2-core machine over ipc://;
# docs/reliability.md states this bound.
DROP_BOUND_S = 5.0
RSS_SLACK_MB = 32  # what serving the streams and the short requests costs the frontend


def short_request_s(client: Client) -> float:
    """Seconds from sending a short greedy request to its final."""
    start = time.monotonic()
    result = client.generate(token_ids=[5] * 8, max_tokens=4, ignore_eos=True, temperature=0)
    assert result.finish_reason == "length" and len(result.token_ids) == 4, result
    return time.monotonic() - start


def test_a_client_that_stops_reading_is_dropped_when_its_send_queue_fills(
    serve_factory, tiny_checkpoint, tmp_path
) -> None:
    server = serve_factory("--model", str(long_context_copy(tiny_checkpoint, tmp_path)), *SERVE_ARGS)
    pid = server.pids["frontend"]
    ctx = zmq.Context()
    with Client(server.address, timeout=30) as watcher, Client(server.address, timeout=30) as other:
        short_request_s(other)  # warm-up
        idle_latency = min(short_request_s(other) for _ in range(3))
        idle_rss = rss_mb(pid)
        before = watcher.metrics()["counters"]

        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.LINGER, 0)
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.setsockopt(zmq.RCVBUF, 4096)
        slow.connect(server.address)
        for i in range(NUM_STREAMS):
            slow.send(
                msgpack.packb(
                    {
                        "type": "generate",
                        "v": 1,
                        "request_id": f"slow-{i}",
                        "token_ids": [7 + i] * 16,
                        "max_tokens": LONG_MAX_TOKENS,
                        "ignore_eos": True,
                        "temperature": 0,
                        "stream": True,
                    }
                )
            )
        stalled = time.monotonic()  # it never reads
        latencies, peak_rss, running = [], idle_rss, 0
        while True:
            stats = watcher.stats()
            took = time.monotonic() - stalled
            running = max(running, stats["in_flight"])
            if running >= NUM_STREAMS and stats["in_flight"] == 0 and stats["held_blocks"] == 0:
                break
            assert took < DROP_BOUND_S, f"the slow client's requests still held {took:.1f} s after it stalled: {stats}"
            latencies.append(short_request_s(other))
            peak_rss = max(peak_rss, rss_mb(pid))
            time.sleep(0.1)
        after = watcher.metrics()["counters"]
        slow.close()
    ctx.term()
    assert after["clients_not_reading"] == before["clients_not_reading"] + 1, (before, after)
    aborted = after["request_success"]["abort"] - before["request_success"]["abort"]
    ran_out = after["request_success"]["length"] - before["request_success"]["length"]
    assert (aborted, ran_out) == (NUM_STREAMS, len(latencies)), (before, after)  # only the short requests ran out
    assert latencies, "no short request was served while the slow client's streams ran"
    assert max(latencies) < 2 * idle_latency + 1.0, (idle_latency, latencies)
    assert peak_rss - idle_rss < RSS_SLACK_MB, (idle_rss, peak_rss)
    assert "not reading its replies" in server.output()
    print(
        f"dropped {took:.2f} s after the stall; short requests {idle_latency * 1000:.0f} ms idle, "
        f"{min(latencies) * 1000:.0f}-{max(latencies) * 1000:.0f} ms meanwhile ({len(latencies)}); "
        f"frontend RSS {idle_rss:.0f} -> peak {peak_rss:.0f} MB"
    )
