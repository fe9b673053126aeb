"""torch's CPU threads in a worker process: how many, and how they wait between parallel regions.

On a shared CPU, OpenMP threads that spin at each barrier collapse a step's time, so the
worker sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (unless the environment names a
policy) and runs one thread per usable core but one, shared by the tensor-parallel ranks,
unless ``--threads`` says otherwise (docs/architecture.md, "CPU threads").
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def passive_waits() -> str:
    """Make OpenMP threads sleep at barriers (``OMP_WAIT_POLICY=PASSIVE``) unless the
    environment already chose a policy; returns the policy in force. Call before importing
    torch: a library already loaded keeps the policy it read."""
    return os.environ.setdefault(WAIT_POLICY, PASSIVE)


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (``taskset``, cpusets), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


#: Cores left to the server's other processes when the worker's threads are not given.
RESERVED_CORES = 1


def worker_threads(num_threads: int | None, ranks: int) -> int:
    """torch's CPU threads for each of ``ranks`` worker ranks: ``num_threads`` when given,
    else an even share of :func:`usable_cores` less :data:`RESERVED_CORES` (at least one)."""
    if num_threads is not None:
        return num_threads
    return max(1, (usable_cores() - RESERVED_CORES) // max(1, ranks))


def cpu_thread_info() -> dict[str, int | str]:
    """What the worker's ready message reports of its CPU threads (bin/serve prints it): torch's
    thread count and the OpenMP wait policy in force (``default``: none was named)."""
    import torch

    return {"threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get(WAIT_POLICY, "default")}
