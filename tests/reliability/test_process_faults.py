"""kill -9 of each of bin/serve's three processes with 20 requests in flight (issue 17,
"Process faults"): every request ends with an error (a ``final`` with ``finish_reason:
"error"`` naming the dead process, or, when the frontend itself dies, ServerGoneError from
the client's liveness check) within 1 s (docs/reliability.md, "Faults"); bin/serve exits non-zero;
nothing is left behind: no process of the tree, no run directory, no shared-memory ring.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from conveyor.client import ServerGoneError
from tests.e2e.serve_harness import children_of, kill_during_streams, mapped_ring_files, run_dir_of, still_alive_after
from tests.reliability.conftest import SERVE_ARGS

NUM_REQUESTS = 20
FAULT_BOUND_S = 1.0  # docs/reliability.md: kill -> every request's error (measured 0.003-0.16 s)
REQUEST_TIMEOUT_S = 60.0  # far past it: a request that hangs fails as TimeoutError


@pytest.mark.parametrize("victim", ["frontend", "scheduler", "worker"])
def test_kill_9_fails_every_request_and_leaves_nothing(serve_factory, tiny_checkpoint, victim) -> None:
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    run_dir = run_dir_of(server.pids["frontend"])
    rings = mapped_ring_files(server.pids["worker"])
    tree = children_of(server.proc.pid)
    assert os.path.isdir(run_dir) and len(rings) == 2 and set(server.pids.values()) <= set(tree)

    outcomes = asyncio.run(
        kill_during_streams(
            server.address, server.pids[victim], NUM_REQUESTS, max_tokens=240, timeout=REQUEST_TIMEOUT_S
        )
    )

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
    assert not still_alive_after(tree, 5)
    assert not os.path.exists(run_dir)
    assert not [path for path in rings if os.path.exists(path)]
