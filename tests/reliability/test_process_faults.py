"""kill -9 of each of bin/serve's three processes with 20 requests in flight (issue 17,
"Process faults"): every request ends with an error (a ``final`` with ``finish_reason:
"error"`` naming the dead process, or, when the frontend itself dies, ServerGoneError from
the client's liveness check) within 5 s; bin/serve exits non-zero; nothing is left behind:
no process of the tree, no run directory, no shared-memory ring.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from conveyor.client import AsyncClient, ServerGoneError

from tests.e2e.serve_harness import alive, children_of, mapped_ring_files, run_dir_of

SERVE_ARGS = ("--num-kv-blocks", "96", "--block-size", "8", "--threads", "1", "--max-num-batched-tokens", "256")
NUM_REQUESTS = 20
FAULT_BOUND_S = 5.0  # the bound on kill -> every request's error
REQUEST_TIMEOUT_S = 60.0  # far past it: a request that hangs fails as TimeoutError


async def _kill_during_streams(address: str, pid: int) -> list[tuple[object, float]]:
    """Each request's outcome (its last Delta, or the exception it raised) and the seconds
    from the kill to it."""
    async with AsyncClient(address, timeout=REQUEST_TIMEOUT_S) as client:
        in_flight = asyncio.Semaphore(0)
        killed_at: list[float] = []

        async def long_request(i: int) -> tuple[object, float]:
            last = None
            try:
                async for delta in client.stream(token_ids=[4 + i] * 10, max_tokens=240, ignore_eos=True, temperature=0):
                    if last is None:
                        in_flight.release()
                    last = delta
            except Exception as exc:  # what the client raised is the outcome checked
                last = exc
            return last, time.monotonic() - killed_at[0]

        tasks = [asyncio.ensure_future(long_request(i)) for i in range(NUM_REQUESTS)]
        for _ in tasks:  # every request has its first token, far from its 240th, before the kill
            await in_flight.acquire()
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize("victim", ["frontend", "scheduler", "worker"])
def test_kill_9_fails_every_request_and_leaves_nothing(serve_factory, tiny_checkpoint, victim) -> None:
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    run_dir = run_dir_of(server.pids["frontend"])
    rings = mapped_ring_files(server.pids["worker"])
    tree = children_of(server.proc.pid)
    assert os.path.isdir(run_dir) and len(rings) == 2 and set(server.pids.values()) <= set(tree)

    outcomes = asyncio.run(_kill_during_streams(server.address, server.pids[victim]))

    for outcome, _ in outcomes:
        if victim == "frontend":
            assert isinstance(outcome, ServerGoneError), outcome
        else:
            assert not isinstance(outcome, Exception), (outcome, server.output())
            assert outcome.finish_reason == "error" and f"{victim} process died" in outcome.result.error, outcome
    slowest = max(seconds for _, seconds in outcomes)
    print(f"kill -9 {victim}: {NUM_REQUESTS} requests failed in {min(s for _, s in outcomes):.3f}..{slowest:.3f} s")
    assert slowest < FAULT_BOUND_S, slowest
    assert server.proc.wait(15) != 0
    assert f"{victim} process died" in server.output()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if alive(pid)]
    assert not os.path.exists(run_dir)
    assert not [path for path in rings if os.path.exists(path)]
