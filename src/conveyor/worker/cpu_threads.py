"""torch's CPU threads in a worker process: how many, where they run, how they wait.

On a shared CPU, OpenMP threads that spin at each barrier collapse a step's time, so the
worker sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (unless the environment names a
policy), runs one thread per usable core but one, shared by the workers of the machine
(every data-parallel replica's tensor-parallel ranks), unless ``--threads`` says otherwise,
and binds them to cores of its own (``--no-cpu-bind``: float) so other work moves off them
(docs/architecture.md, "CPU threads").
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
    """torch's CPU threads for each of ``ranks`` worker processes: ``num_threads`` when given,
    else an even share of :func:`usable_cores` less :data:`RESERVED_CORES` (at least one)."""
    if num_threads is not None:
        return num_threads
    return max(1, (usable_cores() - RESERVED_CORES) // max(1, ranks))


def worker_cores(slot: int, slots: int, threads: int) -> list[int] | None:
    """The cores worker ``slot`` of ``slots`` (one per replica and rank on this machine) binds
    its ``threads`` threads to: its own run of the usable cores, lowest first, disjoint from
    every other slot's, the cores past the last slot's left to the frontend and scheduler.
    None when the slots' threads outnumber the usable cores: bound, they would stack on
    cores while others idle, so they float."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux: nothing to bind with
        return None
    if slots * threads > len(cores):
        return None
    return cores[slot * threads : (slot + 1) * threads]


def bind_process(cores: list[int]) -> None:
    """Run every thread of this process (those to come inherit it) on ``cores`` only. Each
    thread is set, not just the caller: torch's OpenMP pool or a ZeroMQ I/O thread may
    already exist."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass
    os.sched_setaffinity(0, cores)


def core_list(cores: list[int]) -> str:
    """``0-3,8`` for cores 0, 1, 2, 3 and 8: the ``taskset -c`` form."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def cpu_thread_info(cores: list[int] | None) -> dict[str, int | str]:
    """What the worker's ready message reports of its CPU threads (bin/serve prints it): torch's
    thread count, the OpenMP wait policy in force (``default``: none was named) and the cores
    the threads are bound to (``""``: they float)."""
    import torch

    return {
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get(WAIT_POLICY, "default"),
        "cores": core_list(cores) if cores else "",
    }
