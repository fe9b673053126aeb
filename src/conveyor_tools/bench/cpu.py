"""CPU time spent over a measured window, per process: what each token cost, not just how long.

On a machine with few cores the load generator and every server process share the CPU, so
wall-clock throughput alone cannot say which process a difference comes from. A
:class:`CpuMeter` reads this process's CPU time (the load generator) and, through a probe
such as :meth:`conveyor_tools.bench.server.BenchServer.cpu_seconds`, each server process's, at
the start and the end of the window; the differences are the window's cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable

LOAD_GENERATOR = "load_generator"

CpuProbe = Callable[[], dict[str, float]]


class CpuMeter:
    """Started on creation; :meth:`stop` returns CPU seconds by process name."""

    def __init__(self, probe: CpuProbe | None = None) -> None:
        self._probe = probe
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        out = dict(self._probe()) if self._probe is not None else {}
        out[LOAD_GENERATOR] = time.process_time()
        return out

    def stop(self) -> dict[str, float]:
        end = self._read()
        return {name: end[name] - self._start[name] for name in end if name in self._start}


def per_token_us(cpu_s: dict[str, float], tokens: int) -> dict[str, float]:
    """Microseconds of CPU per output token, by process."""
    return {name: 1e6 * seconds / tokens for name, seconds in cpu_s.items()} if tokens else {}
