"""What the scripts in bench/ share: timing a call per round, and writing the report a run
asked for. A script imports it as a sibling (``python bench/<script>.py`` puts bench/ first on
the path), as bench/frontend_step.py and bench/frontend_load.py import bench/frontend_load_procs.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def per_call_us(call: Callable[[], Any], calls_per_round: int, rounds: int, warmup_calls: int) -> list[float]:
    """Each of ``rounds`` rounds' mean time of one ``call``, in microseconds, over
    ``calls_per_round`` calls back to back, after ``warmup_calls`` untimed calls."""
    for _ in range(warmup_calls):
        call()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls_per_round):
            call()
        per_call.append((time.perf_counter_ns() - start) / calls_per_round / 1000)
    return per_call


def write_report(path: str, report: dict[str, Any]) -> None:
    """``report`` as JSON (indent 1) at ``path``; nothing when ``path`` is empty (not asked for)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
