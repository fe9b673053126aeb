"""bin/serve with and without overlap (planning step N+1 while the worker runs step N), and
over both plan transports (the plain loop on ZeroMQ, the overlapped one on shared memory),
and with the worker's pipelined steps (step N+1 launched before step N's tokens are read).

The same mixed workload (concurrent streams of different lengths, stop token ids, stop
strings, aborts mid-stream, a KV pool small enough to force preemption) must give the same
greedy tokens, texts and finish reasons on both loops, and leave no KV block held.
"""

from __future__ import annotations

import asyncio

from conveyor.client import AsyncClient, Client
from tests.e2e.test_serve import wait_for_free_blocks

# 40 blocks of 8 tokens for 20 concurrent requests of up to ~95 tokens: preemption happens.
SERVE_ARGS = ("--num-kv-blocks", "40", "--block-size", "8", "--threads", "1", "--max-num-batched-tokens", "64")
N = 20


def prompt(i: int) -> list[int]:
    return [(11 * i + 3 * j) % 190 + 10 for j in range(4 + (i * 7) % 30)]


def max_tokens(i: int) -> int:
    return 60 if i % 4 == 3 else 8 + (i * 5) % 33  # the ones aborted after two deltas run long


async def _stream(client: AsyncClient, rid: str, i: int, abort_after: int | None = None, **kwargs):
    """Stream request i; with ``abort_after``, abort it after that many deltas."""
    ids, text, final = [], [], None
    stream = client.stream(
        token_ids=prompt(i), max_tokens=max_tokens(i), temperature=0, ignore_eos=True, request_id=rid, **kwargs
    )
    n = 0
    async for delta in stream:
        ids += delta.token_ids
        text.append(delta.text)
        final = delta
        n += 1
        if abort_after is not None and n == abort_after:
            await client.abort(rid)
    return ids, "".join(text), final.finish_reason if final else None


def run_workload(address: str, base: dict[int, tuple[list[int], str]] | None):
    """Without ``base``: every request unconstrained. With it: stops and aborts derived from it."""

    async def main():
        async with AsyncClient(address, timeout=300) as client:
            jobs = []
            for i in range(N):
                kwargs: dict = {}
                abort_after = None
                if base is not None:
                    ids, text = base[i]
                    if i % 4 == 1:
                        kwargs["stop_token_ids"] = [ids[len(ids) // 2]]
                    elif i % 4 == 2 and len(text.strip()) >= 6:
                        kwargs["stop"] = [text[len(text) // 2 : len(text) // 2 + 2]]
                    elif i % 4 == 3:
                        abort_after = 2
                # Fresh ids: reusing a finished request's id would continue it (a second turn).
                rid = f"{'free' if base is None else 'mixed'}-{i}"
                jobs.append(_stream(client, rid, i, abort_after, **kwargs))
            return await asyncio.gather(*jobs)

    return dict(enumerate(asyncio.run(main())))


MODES = {
    "--no-overlap": ("--no-overlap", "--plan-transport", "zmq"),
    "--overlap": ("--overlap", "--plan-transport", "shm"),
    # The worker's pipelined loop (on by default only with CUDA): step N+1 launched before
    # N's tokens are read back, its decode inputs taken from the device-side buffer.
    "--pipeline-steps": ("--overlap", "--plan-transport", "shm", "--pipeline-steps", "on"),
}


def test_overlap_and_plain_loops_give_identical_outputs(serve_factory, tiny_checkpoint, hf_greedy) -> None:
    outputs = {}
    for mode, args in MODES.items():
        server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, *args)
        free = run_workload(server.address, None)
        for i in range(N):  # chunked, preempted and resumed under load, yet transformers' tokens
            assert free[i][0] == hf_greedy(prompt(i), max_tokens(i)), (mode, i)
        mixed = run_workload(server.address, {i: (ids, text) for i, (ids, text, _) in free.items()})
        with Client(server.address, timeout=60) as client:
            stats = wait_for_free_blocks(client)
        assert stats["held_blocks"] == 0, (mode, stats)
        assert stats["num_preemptions"] > 0, (mode, stats)
        assert (stats["num_planned_ahead"] > 0) == (mode != "--no-overlap"), (mode, stats["num_planned_ahead"])
        outputs[mode] = (free, mixed)
        server.terminate()

    free_a, mixed_a = outputs["--no-overlap"]
    for mode in ("--overlap", "--pipeline-steps"):
        free_b, mixed_b = outputs[mode]
        assert free_a == free_b, mode
        for i in range(N):
            ids, text, reason = mixed_b[i]
            if i % 4 == 3:  # aborted after two deltas: a prefix of the free run, however far it got
                assert reason == "abort" and ids == free_b[i][0][: len(ids)], (mode, i)
                assert mixed_a[i][2] == "abort"
            else:
                assert mixed_a[i] == mixed_b[i], (mode, i)
                if i % 4 == 1:
                    assert reason == "stop" and ids[-1] == free_b[i][0][len(free_b[i][0]) // 2], (mode, i)
