"""Bookkeeping of the CPU swap space: which CPU blocks hold what, and the copies a plan carries.

The worker owns ``num_cpu_blocks`` CPU blocks shaped like its GPU blocks; this module decides
which of them each copy uses. It holds three kinds of CPU block references:

- a **swapped-out request** holds the CPU blocks its KV was copied to until it is resumed,
  aborted or finished;
- a CPU block that holds a full block under its content hash stays **cached** when nobody
  holds it any more (after a swap-in, or after an offloaded GPU eviction): a later prefix
  hit swaps it in instead of recomputing it;
- **step holds**: every CPU block a plan reads or writes is held until that plan's result
  has come back (:meth:`end_step`). So no CPU block is reused within one plan, and a block
  released while a copy into it is still pending cannot be handed out again before that copy
  has run. That is what lets the worker run all swap-outs, then all swap-ins, each as one
  batched copy (see ``StepPlan``).

Copies are collected here while a plan is formed and taken with :meth:`take_transfers`;
copies planned when :meth:`~conveyor.scheduler.scheduler.Scheduler.schedule` ends up with
nothing to run stay pending for the next plan.
"""

from __future__ import annotations

from conveyor.scheduler.block_pool import BlockPool
from conveyor.scheduler.prefix_index import PrefixIndex


class SwapSpace:
    """The CPU block pool plus this plan's swap-out / swap-in pairs and step holds."""

    def __init__(self, num_cpu_blocks: int, index: PrefixIndex | None = None) -> None:
        self.pool: BlockPool | None = BlockPool(num_cpu_blocks, index) if num_cpu_blocks > 0 else None
        self.swap_out: list[list[int]] = []  # [gpu_block, cpu_block]
        self.swap_in: list[list[int]] = []  # [cpu_block, gpu_block]
        self._step_holds: list[int] = []
        self._plan_holds: list[int] = []  # holds of the plan in flight, released by end_step
        self.num_swapped_out = 0  # counters since start, in blocks
        self.num_swapped_in = 0
        self.num_held_by_requests = 0  # CPU blocks swapped-out requests hold now

    @property
    def total(self) -> int:
        return self.pool.total if self.pool is not None else 0

    @property
    def num_available(self) -> int:
        """CPU blocks a swap-out or offload may take now (free or cached)."""
        return self.pool.num_available if self.pool is not None else 0

    # ------------------------------------------------------------------ copies out

    def swap_out_blocks(self, gpu_blocks: list[int], hashes: list[int | None]) -> list[int]:
        """Plan copies of ``gpu_blocks`` into fresh CPU blocks (returned, held by the caller).

        ``hashes[i]`` is block ``i``'s content id when it is a full computed block; the CPU
        copy is registered under it so it can outlive the swapped request as a cache entry.
        The caller has checked :attr:`num_available`.
        """
        assert self.pool is not None
        cpu_blocks = self.pool.allocate(len(gpu_blocks))
        for g, c, h in zip(gpu_blocks, cpu_blocks, hashes):
            self.swap_out.append([g, c])
            if h is not None:
                self.pool.register(c, h)
        self.num_swapped_out += len(gpu_blocks)
        self.num_held_by_requests += len(cpu_blocks)
        return cpu_blocks

    def offload(self, gpu_block: int, block_hash: int) -> None:
        """Copy an evicted GPU prefix-cache block to the CPU tier, if it is not there already
        and a CPU block can be had. Best effort: a cache, not a promise."""
        pool = self.pool
        if pool is None or pool.lookup(block_hash) is not None or pool.num_available == 0:
            return
        (cpu_block,) = pool.allocate(1)
        pool.register(cpu_block, block_hash)
        self._step_holds.append(cpu_block)
        self.swap_out.append([gpu_block, cpu_block])
        self.num_swapped_out += 1

    # ------------------------------------------------------------------ copies in

    def lookup(self, block_hash: int) -> int | None:
        """The CPU block holding this full block, or None."""
        return self.pool.lookup(block_hash) if self.pool is not None else None

    def hold_for_step(self, cpu_block: int) -> None:
        """Take a step hold on a CPU block found by :meth:`lookup` (before any allocation that could evict it)."""
        assert self.pool is not None
        self.pool.acquire(cpu_block)
        self._step_holds.append(cpu_block)

    def swap_in_block(self, cpu_block: int, gpu_block: int) -> None:
        """Plan a copy of ``cpu_block`` into ``gpu_block``. The caller holds ``cpu_block`` (a
        step hold, or a reference it hands over with :meth:`release_after_step`)."""
        self.swap_in.append([cpu_block, gpu_block])
        self.num_swapped_in += 1

    def release_after_step(self, cpu_blocks: list[int]) -> None:
        """Drop a swapped-out request's references to ``cpu_blocks`` once the next plan has run."""
        self._step_holds.extend(cpu_blocks)
        self.num_held_by_requests -= len(cpu_blocks)

    # ------------------------------------------------------------------ per plan

    def take_transfers(self) -> tuple[list[list[int]], list[list[int]]]:
        """The copies of the plan being sent; its holds are released by :meth:`end_step`."""
        out, inn = self.swap_out, self.swap_in
        self.swap_out, self.swap_in = [], []
        self._plan_holds.extend(self._step_holds)
        self._step_holds = []
        return out, inn

    def end_step(self) -> None:
        """The plan in flight has run: release what it held."""
        if self._plan_holds:
            assert self.pool is not None
            self.pool.free(self._plan_holds)
            self._plan_holds = []
        self.settle()

    def settle(self) -> None:
        """With no plan in flight, release step holds that no pending copy needs any more
        (references handed over by requests that ended while nothing was pending)."""
        if self._step_holds and not self.swap_out and not self.swap_in:
            assert self.pool is not None
            self.pool.free(self._step_holds)
            self._step_holds = []

    def holds(self) -> list[int]:
        """Every step hold (this plan's and the one in flight), for invariant checks."""
        return self._step_holds + self._plan_holds
