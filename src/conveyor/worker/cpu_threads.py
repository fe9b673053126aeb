"""torch's CPU threads in a worker process: how many, and how they wait between parallel regions.

Why it matters (docs/benchmarks.md, "CPU: where the time goes and why a busy machine
collapsed it"): on CPU every torch operator of a step (about 20 per layer) is one OpenMP
parallel region ending in a barrier. The torch CPU wheels use GNU OpenMP, whose threads,
with ``OMP_WAIT_POLICY`` unset, *spin* at each barrier before sleeping. When the cores are
shared (the frontend and scheduler of the same server, another process, another tenant),
a spinning thread burns its share of a core while the thread it waits for is not running,
the kernel then runs the spinner less, and every barrier waits a time slice: on the 2-core
machine, with other work running, a 30-layer decode step of SmolLM2-135M went from ~0.2 s
with one thread to ~1.9 s with two (median; 2.8 s max). With passive waits (a thread that
reaches a barrier first sleeps in the kernel at once) the same two threads took ~0.1 s.

So the worker

* sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported (GNU OpenMP reads it once, when
  the library loads), unless the environment already names a policy: the operator's choice
  stands (``OMP_WAIT_POLICY=ACTIVE`` for a machine whose cores are the worker's alone);
* runs one thread per core it may run on (``os.sched_getaffinity``, so ``taskset`` and
  container cpusets count, unlike torch's default of the machine's physical cores) but one,
  which is left to the frontend and scheduler (they work during every step: the scheduler
  plans the next one, the frontend streams the last one's tokens), shared evenly by the
  tensor-parallel ranks, unless ``--threads`` says otherwise. vLLM's CPU build reserves a
  core the same way. On the 2-core machine, while other work ran, two passive worker threads
  took 1.08x, 1.15x and 1.41x one thread's decode step at batch 1, 8 and 32 (two runs
  minutes apart), and a large copy ran no faster on two cores than on one: the decode step
  is bound by a memory bandwidth one core nearly saturates there.

:class:`conveyor.Engine` runs the model in the caller's process, where torch is usually
imported already: there the caller's environment decides the wait policy.
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
