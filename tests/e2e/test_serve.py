"""bin/serve end to end: real processes, real sockets, a real checkpoint.

Greedy outputs are compared with HF transformers ``generate`` on the same
checkpoint; the block pool is read back through the stats call to prove that
aborts, disconnects, errors and completions all return their KV blocks.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from conveyor.client import AsyncClient, Client
from tests.e2e.serve_harness import (
    LONG_MAX_TOKENS,
    LONG_SERVE_ARGS,
    REPO,
    alive,
    assert_aborted_and_freed,
    finished_counts,
    long_context_copy,
    mapped_ring_files,
    still_alive_after,
)

NUM_BLOCKS = 96
SERVE_ARGS = (
    "--num-kv-blocks",
    str(NUM_BLOCKS),
    "--block-size",
    "8",
    "--threads",
    "1",
    "--max-num-batched-tokens",
    "256",
)


def wait_for_free_blocks(client: Client, timeout: float = 5.0) -> dict:
    """Poll stats until every block is free again (blocks are freed within an iteration)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        assert stats["free_blocks"] + stats["cached_blocks"] + stats["held_blocks"] == stats["total_blocks"]
        if stats["held_blocks"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture
def server(serve_factory, tiny_checkpoint):
    return serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)


def test_concurrent_streams_match_hf(server, hf_greedy) -> None:
    """32 streamed requests of different lengths, served concurrently, each equal to HF alone."""
    prompts = [[(7 * i + j) % 200 + 10 for j in range(3 + (i * 5) % 40)] for i in range(32)]
    lengths = [4 + (i * 7) % 29 for i in range(32)]

    async def one(client: AsyncClient, i: int):
        text, ids, last = [], [], None
        async for delta in client.stream(token_ids=prompts[i], max_tokens=lengths[i], temperature=0, ignore_eos=True):
            text.append(delta.text)
            ids += delta.token_ids
            last = delta
        return "".join(text), ids, last

    async def run_all():
        async with AsyncClient(server.address, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    for i, (text, ids, last) in enumerate(results):
        assert last.finish_reason == "length", last
        assert last.result.usage.completion_tokens == lengths[i]
        assert last.result.usage.prompt_tokens == len(prompts[i])
        assert ids == last.result.token_ids
        assert text == last.result.text
        timing = last.result.timing
        assert 0 <= timing["queue_time"] <= timing["ttft"] <= timing["total"]
    for i in (0, 5, 17, 31):
        assert results[i][1] == hf_greedy(prompts[i], lengths[i]), f"request {i} differs from HF"
    with Client(server.address) as client:
        stats = wait_for_free_blocks(client)
    assert stats["held_blocks"] == 0 and stats["num_running"] == 0


def test_text_prompt_chat_and_sync_client(server, hf_greedy) -> None:
    from conveyor.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(server_model_dir(server))
    with Client(server.address, timeout=60) as client:
        result = client.generate("The quick brown fox", max_tokens=6, temperature=0, ignore_eos=True)
        assert result.finish_reason == "length"
        assert result.token_ids == hf_greedy(tok.encode("The quick brown fox"), 6)
        assert result.text == tok.decode(result.token_ids)
        chat = client.generate(
            messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0, ignore_eos=True
        )
        assert chat.usage.prompt_tokens == len(tok.apply_chat_template([{"role": "user", "content": "hello"}]))
        # sampling with a seed is reproducible
        a = client.generate("abc", max_tokens=8, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
        b = client.generate("abc", max_tokens=8, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
        assert a.token_ids == b.token_ids


def server_model_dir(server) -> str:
    args = server.proc.args
    return args[args.index("--model") + 1]


def test_stop_token_ids_and_stop_strings(server) -> None:
    request = dict(token_ids=[11, 12, 13], max_tokens=24, temperature=0, ignore_eos=True)
    with Client(server.address, timeout=60) as client:
        base = client.generate(**request)
        stop_id = base.token_ids[4]
        cut = client.generate(**request, stop_token_ids=[stop_id])
        assert cut.finish_reason == "stop"
        assert cut.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
        # A stop string taken from the middle of the unconstrained text (24 tokens: always long
        # enough): the text ends right before its first occurrence, which is not at the start.
        text = base.text
        assert len(text) >= 8, text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        expected = text[: text.index(stop)]
        assert expected, (text, stop)
        streamed = []
        final = None
        for d in client.stream(**request, stop=[stop]):
            streamed.append(d.text)
            final = d
        assert final.finish_reason == "stop"
        assert final.result.text == expected
        assert "".join(streamed) == expected
        wait_for_free_blocks(client)


def test_abort_mid_stream_frees_blocks(server) -> None:
    with Client(server.address, timeout=60) as client:
        stream = client.stream(
            token_ids=list(range(10, 60)), max_tokens=150, temperature=0, ignore_eos=True, request_id="victim"
        )
        for i, delta in enumerate(stream):
            if i == 3:
                break
        stream.close()  # leaving early aborts the request
        stats = wait_for_free_blocks(client)
        assert stats["held_blocks"] == 0 and stats["in_flight"] == 0
        # explicit abort by id while another client waits for its result
        with Client(server.address, timeout=60) as other:
            other._send(
                {
                    "type": "generate",
                    "v": 1,
                    "request_id": "r-abort",
                    "token_ids": [5] * 30,
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                }
            )
            first = other._next("r-abort")
            assert first["type"] == "delta"
            client.abort("r-abort")  # ids are per client: this names no request of `client`
            for _ in range(5):  # `other`'s request goes on streaming
                assert other._next("r-abort")["type"] == "delta"
            other.abort("r-abort")
            while True:
                msg = other._next("r-abort")
                if msg["type"] == "final":
                    break
            assert msg["finish_reason"] == "abort"
        assert wait_for_free_blocks(client)["held_blocks"] == 0


def test_client_disconnect_aborts_its_request(serve_factory, tiny_checkpoint, tmp_path) -> None:
    """A DEALER that goes away while its request (streamed, then unstreamed) would run for
    thousands of tokens more: the frontend aborts the request, counted as an abort, and its
    blocks are free within ABORT_BOUND_S of the disconnect."""
    server = serve_factory("--model", str(long_context_copy(tiny_checkpoint, tmp_path)), *LONG_SERVE_ARGS)
    ctx = zmq.Context.instance()
    with Client(server.address) as watcher:
        for stream in (True, False):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(server.address)
            req = {
                "type": "generate",
                "v": 1,
                "token_ids": [9] * 40,
                "max_tokens": LONG_MAX_TOKENS,
                "ignore_eos": True,
                "stream": stream,
            }
            sock.send(msgpack.packb(req))
            if stream:  # streaming: its first delta is here
                assert sock.poll(30_000) and msgpack.unpackb(sock.recv())["type"] == "delta"
            deadline = time.monotonic() + 30
            while watcher.stats()["held_blocks"] == 0:  # running at the scheduler
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
            before = finished_counts(watcher)
            sock.close(linger=0)
            took = assert_aborted_and_freed(watcher, before, time.monotonic())
            print(f"stream={stream}: blocks free {took:.3f} s after the disconnect")


def test_new_client_on_a_reused_fd_is_not_taken_for_the_gone_one(server) -> None:
    """A client that disconnects while the frontend drains a burst of messages, and a new
    client that connects (the server's fd of the old connection reused for the new one)
    and sends at once: the disconnect drops the old client's request only. Before the
    frontend handled pending disconnects ahead of each client message, about half of the
    new clients here never got a reply."""
    ctx = zmq.Context.instance()
    busy = ctx.socket(zmq.DEALER)
    busy.connect(server.address)
    n = 0
    try:
        for i in range(8):
            gone = ctx.socket(zmq.DEALER)
            gone.connect(server.address)
            gone.send(
                msgpack.packb(
                    {
                        "type": "generate",
                        "v": 1,
                        "request_id": f"gone{i}",
                        "token_ids": [5] * 8,
                        "max_tokens": 100,
                        "ignore_eos": True,
                        "stream": True,
                    }
                )
            )
            assert gone.poll(30_000), "no first token"
            for _ in range(200):  # a burst the frontend drains in one pass
                n += 1
                busy.send(
                    msgpack.packb(
                        {"type": "generate", "v": 1, "request_id": f"busy{n}", "token_ids": [7] * 4, "max_tokens": 1}
                    )
                )
            time.sleep(0.002)
            gone.close(linger=0)
            new = ctx.socket(zmq.DEALER)
            new.connect(server.address)
            new.send(
                msgpack.packb(
                    {
                        "type": "generate",
                        "v": 1,
                        "request_id": f"new{i}",
                        "token_ids": [6] * 8,
                        "max_tokens": 2,
                        "ignore_eos": True,
                    }
                )
            )
            assert new.poll(30_000), f"round {i}: the new client's request was dropped with the gone one's"
            reply = msgpack.unpackb(new.recv())
            assert reply["request_id"] == f"new{i}" and reply["finish_reason"] == "length", reply
            new.close(linger=0)
            while busy.poll(0):
                busy.recv()
    finally:
        busy.close(linger=0)
    with Client(server.address, timeout=60) as client:
        assert wait_for_free_blocks(client, timeout=30)["held_blocks"] == 0


def test_generate_given_up_aborts_its_request(server) -> None:
    """A request the caller stops waiting for (an asyncio ``generate`` cancelled, a stream
    left early, Ctrl-C in the sync client) is aborted, and its id can be sent again at once:
    the new turn continues the aborted one and gets its own result, never the old turn's
    abort final (nor an "already in flight" error)."""
    long = {"token_ids": list(range(10, 40)), "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def cancelled() -> None:
        async with AsyncClient(server.address, timeout=60) as client:
            task = asyncio.ensure_future(client.generate(request_id="given-up", **long))
            deadline = time.monotonic() + 10
            while (await client.stats())["held_blocks"] == 0:  # the request is running
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            again = await client.generate(request_id="given-up", token_ids=[7], max_tokens=2, temperature=0)
            assert again.finish_reason == "length" and len(again.token_ids) == 2, again
            # A stream left early, its id reused at once: the new turn gets none of the old one's replies.
            stream = client.stream(request_id="left", **long)
            async for _ in stream:
                break
            await stream.aclose()
            again = await client.generate(request_id="left", token_ids=[7], max_tokens=2, temperature=0)
            assert again.finish_reason == "length" and len(again.token_ids) == 2, again
            # A stream read up to its final and left there (neither iterated to the end nor
            # closed): its id is free on the client at once.
            async for delta in client.stream(request_id="done", token_ids=[7], max_tokens=2, temperature=0):
                if delta.finish_reason is not None:
                    break
            again = await client.generate(request_id="done", token_ids=[8], max_tokens=2, temperature=0)
            assert again.finish_reason == "length" and len(again.token_ids) == 2, again

    asyncio.run(cancelled())

    with Client(server.address, timeout=60) as client:
        real_next = client._next

        def interrupted(key: str) -> dict:  # Ctrl-C while the request runs
            with Client(server.address, timeout=60) as watcher:
                deadline = time.monotonic() + 10
                while watcher.stats()["held_blocks"] == 0:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            raise KeyboardInterrupt

        client._next = interrupted
        with pytest.raises(KeyboardInterrupt):
            client.generate(request_id="interrupted", **long)
        client._next = real_next
        again = client.generate(request_id="interrupted", token_ids=[7], max_tokens=2, temperature=0)
        assert again.finish_reason == "length" and len(again.token_ids) == 2, again
        assert wait_for_free_blocks(client)["held_blocks"] == 0


BAD_INPUTS = [
    ({"token_ids": [1, 2], "top_p": 0}, "top_p"),
    ({"token_ids": [1, 2], "temperature": -1}, "temperature"),
    ({"token_ids": [1, 2], "top_k": -3}, "top_k"),
    ({"token_ids": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"token_ids": [1, 2], "max_tokens": 10_000}, "model length"),
    ({"token_ids": [10**9]}, "vocabulary"),
    ({"token_ids": [-1]}, "vocabulary"),
    ({"token_ids": [1] * 300}, "limit"),
    ({"prompt": ""}, "empty"),
    ({"prompt": 12}, "'prompt' must be a string"),
    ({"token_ids": "abc"}, "token_ids"),
    ({}, "exactly one of"),
    ({"prompt": "x", "min_p": 3}, "min_p"),
    ({"prompt": "x", "mystery": 1}, "unknown field"),
]


def test_bad_inputs_get_errors_while_others_are_served(server) -> None:
    ctx = zmq.Context.instance()
    with Client(server.address, timeout=60) as good:
        good._send(
            {
                "type": "generate",
                "v": 1,
                "request_id": "good",
                "token_ids": [3] * 20,
                "max_tokens": 40,
                "temperature": 0,
                "ignore_eos": True,
            }
        )
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.address)
        for i, (fields, needle) in enumerate(BAD_INPUTS):
            sock.send(msgpack.packb({"type": "generate", "v": 1, "request_id": f"bad{i}", **fields}))
            reply = msgpack.unpackb(sock.recv())
            assert reply["type"] == "final" and reply["finish_reason"] == "error", reply
            assert reply["request_id"] == f"bad{i}"
            assert needle in reply["error"], (needle, reply["error"])
        # Not even a map, not msgpack, an unknown type, a wrong version: an error, never a crash.
        for raw, needle in [
            (b"\xc1\xc1", "malformed"),
            (msgpack.packb([1, 2, 3]), "map"),
            (msgpack.packb({"type": "launch"}), "unknown message type"),
            (msgpack.packb({"type": "generate", "v": 99, "prompt": "x"}), "version"),
        ]:
            sock.send(raw)
            reply = msgpack.unpackb(sock.recv())
            assert reply["type"] in ("error", "final") and needle in (reply.get("message") or reply.get("error")), reply
        # Ids are per client: `good`'s id from this socket is this socket's own request.
        sock.send(msgpack.packb({"type": "generate", "v": 1, "request_id": "good", "prompt": "x", "max_tokens": 2}))
        reply = msgpack.unpackb(sock.recv())
        assert reply["type"] == "final" and reply["finish_reason"] != "error", reply
        # An id already in flight on the same client is refused (an `error`, not a `final`)
        # without touching the original, which ends with its own final.
        sock.send(
            msgpack.packb(
                {
                    "type": "generate",
                    "v": 1,
                    "request_id": "mine",
                    "token_ids": [3] * 20,
                    "max_tokens": 40,
                    "ignore_eos": True,
                }
            )
        )
        sock.send(msgpack.packb({"type": "generate", "v": 1, "request_id": "mine", "prompt": "x"}))
        reply = msgpack.unpackb(sock.recv())
        assert reply["type"] == "error" and reply["code"] == "duplicate_request_id", reply
        assert reply["request_id"] == "mine" and "already in flight" in reply["message"]
        reply = msgpack.unpackb(sock.recv())
        assert reply["type"] == "final" and reply["finish_reason"] == "length" and len(reply["token_ids"]) == 40
        sock.close(linger=0)
        while True:
            msg = good._next("good")
            if msg["type"] == "final":
                break
        assert msg["finish_reason"] == "length" and len(msg["token_ids"]) == 40
        stats = wait_for_free_blocks(good)
        assert stats["held_blocks"] == 0


def test_sigterm_leaves_no_process(serve_factory, tiny_checkpoint) -> None:
    """Nor any file: the shared-memory plan rings go with the run directory."""
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    kids = list(server.pids.values())
    assert all(alive(p) for p in kids)
    rings = mapped_ring_files(server.pids["worker"])
    assert len(rings) == 2, rings  # plans and results
    start = time.monotonic()
    assert server.terminate() == 0
    assert time.monotonic() - start < 10
    assert not still_alive_after(kids, 5)
    assert not [path for path in rings if os.path.exists(path)]


def test_bin_client_streams_from_demo_model(serve_factory) -> None:
    server = serve_factory("--model", "demo", "--num-kv-blocks", "64", "--threads", "1")
    assert "random weights" in "".join(server.stdout)
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bin" / "client"),
            "--host",
            server.address,
            "--max-tokens",
            "8",
            "--ignore-eos",
            "Hello",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "[length; " in out.stderr and "8 completion tokens" in out.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--device", "cuda"], "no CUDA device"),
        (["--model", "/nonexistent/checkpoint"], "no config.json"),
    ],
)
def test_startup_failures_are_clear(args, needle, tiny_checkpoint, tmp_path) -> None:
    if "--device" in args and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    if "--model" not in args:
        args = ["--model", str(tiny_checkpoint), *args]
    out = subprocess.run(
        [sys.executable, str(REPO / "bin" / "serve"), "--host", f"ipc://{tmp_path}/s.sock", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert needle in out.stderr, out.stderr
    assert "ready on" not in out.stdout


def test_sampling_controls_over_zeromq_match_hf(server, hf_controlled) -> None:
    """Penalties, logit_bias (int keys, sent as strings) and min_tokens over the client
    protocol, concurrently, each against transformers with the matching processors."""
    from conveyor.frontend.tokenizer import Tokenizer

    eos = Tokenizer.from_dir(server_model_dir(server)).eos_token_id
    prompts = [[5 + (3 * i + 7 * j) % 60 for j in range(10)] for i in range(3)]
    cases = [
        dict(presence_penalty=-2.0, frequency_penalty=0.5, ignore_eos=True),
        dict(repetition_penalty=1.8, logit_bias={9: 4.0, 30: 3.5}, ignore_eos=True),
        dict(logit_bias={40: 100.0}, stop_token_ids=[40], min_tokens=4),
    ]
    stops = [(), (), (40, eos)]

    async def run() -> list:
        async with AsyncClient(server.address, timeout=60) as client:
            return await asyncio.gather(
                *[client.generate(token_ids=p, max_tokens=12, temperature=0, **c) for p, c in zip(prompts, cases)]
            )

    results = asyncio.run(run())
    for p, c, stop, result in zip(prompts, cases, stops, results):
        controls = {k: v for k, v in c.items() if k not in ("stop_token_ids", "ignore_eos")}
        assert result.token_ids == hf_controlled(p, 12, stop=stop, **controls), c
    assert results[2].token_ids[-1] == 40 and len(results[2].token_ids) == 5 and results[2].finish_reason == "stop"
