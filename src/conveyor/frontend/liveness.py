"""Noticing a scheduler that stops answering while it owes work (``--hang-timeout``, ``--on-hang``).

The scheduler's own loop notices a hung worker (:mod:`conveyor.scheduler.liveness`); a hung
scheduler (SIGSTOP, a deadlock) can only be noticed from outside. A scheduler that owes
requests sends outputs every step, and answers a ``StatsQuery`` within a poll slice even while
its worker computes a long step; so :class:`SchedulerWatch` notes when each replica's
scheduler was last heard from, asks it a stats query once it has been silent
:data:`PROBE_AFTER_S` with requests outstanding, and calls it hung once it has been silent
``timeout`` seconds. The frontend then fails the requests that replica owes with
"scheduler hung: ..." (an HTTP 503), and either stops the server (``exit``, through its own
shutdown, exit status :data:`conveyor.scheduler.liveness.HANG_EXIT_CODE`) or routes nothing
there (new requests refused while no replica answers) until it is heard from again, telling it
to abort what it was failed for (``wait``). ``/health`` is 503 meanwhile: its stats query is
not answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from conveyor.ipc.messages import StatsQuery

PROBE_AFTER_S = 1.0
# How often the frontend looks (the bound is the timeout plus this).
WATCH_INTERVAL_S = 0.25


class SchedulerWatch:
    """When each replica's scheduler was last heard from, and which are hung."""

    def __init__(self, timeout: float, on_hang: str, replicas, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.exit = on_hang == "exit"
        self.replicas = replicas  # conveyor.frontend.replicas.ReplicaSet
        self.clock = clock
        now = clock()
        self.last = [now] * len(replicas)
        self.probed = [False] * len(replicas)
        self.hung = [False] * len(replicas)

    def heard(self, index: int) -> bool:
        """Replica ``index``'s scheduler sent something; True if it was hung until now."""
        self.last[index] = self.clock()
        self.probed[index] = False
        was, self.hung[index] = self.hung[index], False
        return was

    def check(self) -> list[tuple[int, float]]:
        """Probe the silent schedulers that owe requests; those newly hung, with their silence."""
        now = self.clock()
        hung = []
        for replica in self.replicas.live():
            i = replica.index
            if not replica.outstanding:
                self.last[i] = now  # owes nothing: silence is idleness
                continue
            silent = now - self.last[i]
            if silent > PROBE_AFTER_S and not self.probed[i]:
                replica.link.send(StatsQuery(f"liveness-{i}"))
                self.probed[i] = True
            if silent > self.timeout:
                self.hung[i] = True
                hung.append((i, silent))
        return hung

    def error(self, index: int, silent: float) -> str:
        what = (
            "the server is stopping (--on-hang exit)"
            if self.exit
            else "its requests are refused until it answers (--on-hang wait)"
        )
        return (
            f"scheduler hung: replica {index}'s scheduler did not answer for {silent:.1f} s (--hang-timeout "
            f"{self.timeout:g}); {what}"
        )

    def refusal(self) -> str | None:
        """The error for a new request while every replica is hung (None: one answers)."""
        if not any(self.hung) or any(r.alive for r in self.replicas.replicas):
            return None
        return "scheduler hung: no replica's scheduler answers (--on-hang wait); retry later"
