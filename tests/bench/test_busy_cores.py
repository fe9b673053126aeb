"""bin/bench online --busy-cores: spinning processes beside a run, gone after it, and the
rate label that keeps busy runs apart from quiet ones in every report."""

from __future__ import annotations

import math
import os
import time

from conveyor_tools.bench.busy_cores import busy_cores, load_label
from conveyor_tools.bench.vllm_server import _cpu_seconds


def test_busy_cores_spin_while_the_block_runs_and_are_gone_after() -> None:
    with busy_cores(1) as pids:
        assert len(pids) == 1
        time.sleep(0.5)
        assert _cpu_seconds(pids[0]) > 0.05  # spinning, not sleeping
    assert not os.path.exists(f"/proc/{pids[0]}")  # killed and reaped
    with busy_cores(0) as none:
        assert none == []


def test_load_label_keeps_quiet_rates_as_they_are() -> None:
    assert load_label("inf", 0) == "inf" and load_label(2.0, 0) == 2.0
    assert load_label("inf", 1) == "inf+1busy" and load_label(2.5, 2) == "2.5+2busy"
    assert load_label(math.inf, 0) == math.inf
