"""Noticing a worker that stops stepping while work is queued (``--hang-timeout``, ``--on-hang``).

A worker that hangs (SIGSTOP, a stuck collective, a deadlocked kernel) is not a dead one: its
process is there, the step rings stay open, and without this the scheduler waited for its
result for ever: every request hung until its client gave up, and ``/health`` said 200 (the
scheduler still answered stats). :class:`HangWatch` measures how long the worker has given no
step result while a plan is in flight, from the later of the last result and the moment a
plan was sent with none in flight; past ``timeout`` seconds the worker is hung:

- every live request fails with an error final naming the hang ("worker hung: no step
  result for 30 s ...", an HTTP 503), and the stats carry ``num_hung`` = 1 (``/health`` 503);
- ``--on-hang exit`` (the default) then ends the scheduler with
  :data:`conveyor.runtime.process.HANG_EXIT_CODE`, and
  bin/serve stops the server saying why (a supervisor restarts it, as after a death);
- ``--on-hang wait`` keeps serving what it can: new requests are refused with the same error
  until a result arrives, then ``num_hung`` goes back to 0 and requests are served again.

The bound: the hang is noticed within ``timeout`` plus one poll slice (0.1 s) after the last
step result, so ``timeout`` must exceed the longest step the server runs (a full prefill
chunk of ``--max-num-batched-tokens`` on its device; seconds on a CPU): 30 s by default.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class HangWatch:
    """How long the worker has been silent with a plan in flight, and whether that is a hang."""

    def __init__(self, timeout: float, on_hang: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.exit = on_hang == "exit"
        self.clock = clock
        self.progress = clock()
        self.hung_since: float | None = None

    @property
    def hung(self) -> bool:
        return self.hung_since is not None

    def started(self) -> None:
        """A plan was sent with none in flight: the worker's silence counts from now."""
        self.progress = self.clock()

    def stepped(self) -> float | None:
        """A step result arrived; how long the worker was silent before it, if that was a hang
        (None: it was not)."""
        now = self.clock()
        silent, self.progress = now - self.progress, now
        if self.hung_since is None:
            return None
        self.hung_since = None
        return silent

    def check(self) -> str | None:
        """With a plan in flight and no result: the error text the first time the silence
        passes the timeout, else None."""
        if not self.timeout or self.hung_since is not None:
            return None
        silent = self.clock() - self.progress
        if silent <= self.timeout:
            return None
        self.hung_since = self.clock()
        what = (
            "the server is stopping (--on-hang exit)"
            if self.exit
            else "new requests are refused until it steps again (--on-hang wait)"
        )
        return f"worker hung: no step result for {silent:.1f} s (--hang-timeout {self.timeout:g}); {what}"

    def refusal(self) -> str | None:
        """The error for a new request while hung (None: not hung)."""
        if self.hung_since is None:
            return None
        return f"worker hung: no step result for {self.clock() - self.progress:.1f} s (--on-hang wait); retry later"
