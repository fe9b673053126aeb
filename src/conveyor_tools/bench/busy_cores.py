"""A background load of busy cores beside a benchmark run (bin/bench online --busy-cores).

Issue 44's second condition: a server should degrade no worse than vLLM's when another
process keeps one core busy. Each busy core is a child Python process spinning in a loop
(never sleeping, so it holds a whole core the kernel must share or move), started before a
run and killed after it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

SPIN = "while True: pass"


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[list[int]]:
    """``count`` spinning processes for the duration of the block; yields their pids."""
    # Each in a session of its own: another tenant's process, not part of the benchmark's
    # (autogroup scheduling shares CPU per session; bench.server says why that matters).
    procs = [
        subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(count)
    ]
    try:
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def load_label(rate: float | str, count: int) -> float | str:
    """The run's ``rate`` as the reports key it: unchanged when quiet, else ``inf+1busy``, so a
    busy run is compared with the other systems' busy runs at the same rate."""
    if not count:
        return rate
    return f"{rate if isinstance(rate, str) else f'{rate:g}'}+{count}busy"
