"""bin/serve's CPU worker on shared cores: threads from the cores it may use, passive OpenMP
waits, and no process that spins while the server idles (docs/benchmarks.md: a 2-core machine
with other work on it turned 80 ms steps into seconds when the worker's threads spun)."""

from __future__ import annotations

import os
import re
import time

import pytest

from conveyor.client import Client
from tests.e2e.serve_harness import ServeProcess

IDLE_S = 1.0
# CPU seconds a process may spend over an idle second: wake-ups for liveness checks and
# heartbeats cost milliseconds; a spinning loop costs most of the second.
IDLE_CPU_BOUND_S = 0.1


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def ready_line(server: ServeProcess) -> str:
    return next(line for line in server.stdout if "ready on" in line)


def worker_affinity(server: ServeProcess) -> set[int]:
    return os.sched_getaffinity(server.pids["worker"])


def test_worker_threads_waits_and_no_spinning_while_idle(serve_factory, tiny_checkpoint) -> None:
    server = serve_factory("--model", str(tiny_checkpoint), "--device", "cpu")
    cores = sorted(os.sched_getaffinity(0))
    threads = max(1, len(cores) - 1)  # a core left to the frontend and scheduler
    bound = cores[:threads]
    where = f"core {bound[0]}" if threads == 1 else f"cores {bound[0]}-{bound[-1]}"
    assert f"on cpu ({threads} threads on {where}, OpenMP waits PASSIVE)" in ready_line(server)
    assert worker_affinity(server) == set(bound)  # the worker's threads, bound to its cores
    assert os.sched_getaffinity(server.pids["scheduler"]) == set(cores)  # the others float
    with Client(server.address, timeout=60) as client:
        out = client.generate(token_ids=[11, 12, 13], max_tokens=16, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == 16
    time.sleep(0.3)  # the request's last replies drain
    before = {name: cpu_seconds(pid) for name, pid in server.pids.items()}
    time.sleep(IDLE_S)
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in server.pids.items()}
    assert all(s < IDLE_CPU_BOUND_S for s in spent.values()), f"CPU seconds over {IDLE_S} s idle: {spent}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin to fewer")
def test_worker_threads_follow_the_affinity_a_chosen_wait_policy_and_no_cpu_bind(
    serve_factory, tiny_checkpoint, monkeypatch
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})  # bin/serve and its processes inherit it, as under taskset
    try:
        server = serve_factory("--model", str(tiny_checkpoint), "--device", "cpu", "--no-cpu-bind")
    finally:
        os.sched_setaffinity(0, mine)
    assert re.search(r"on cpu \(1 threads floating, OpenMP waits ACTIVE\)", ready_line(server))
    assert worker_affinity(server) == {min(mine)}  # the inherited mask, untouched
