"""Block tables of requests over the GPU pool and the CPU swap space: the KV bookkeeping.

This module knows *how* a request gets, shares, grows, swaps and gives back blocks; the
scheduler decides *when*. All of it is arithmetic on block ids: the worker learns about
the results through the plan (block tables, ``num_computed_tokens``, swap pairs).

Prefix reuse at admission (:meth:`KVCacheManager.match`): with ``N`` known tokens, at most
``N - 1`` can come from the cache (the last one must run, to produce the logits the next
token is sampled from). Full blocks are looked up by chained content id
(:mod:`~conveyor.scheduler.prefix_index`), first on the GPU (held
or cached: shared by reference), then in the CPU tier (swapped in by this plan); then the
GPU cache may hold the first tokens of the next block (what a finished request left in its
last block): that partial block is taken over (it was nobody's any more) and written on
from there.

Registration: a block becomes shareable once all its tokens are computed. The scheduler
registers prompt blocks after each prefill chunk (a system prompt is shared by requests
running side by side); blocks filled by decoding are registered when the request releases
them (finish, abort, preemption, swap-out), which is when anyone could want them: a
continuation, or the request itself coming back. A block swapped in for a CPU hit is
registered at once, since the plan that fills it runs before anyone could read it.

Release (:meth:`free`): full registered blocks go to the GPU cache, the last partly filled
block to the partial cache, anything not yet computed to the free list.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.runtime.config import SchedulerConfig
from conveyor.scheduler.block_pool import BlockPool
from conveyor.scheduler.policy import blocks_for
from conveyor.scheduler.prefix_index import PrefixIndex
from conveyor.scheduler.request import RequestStatus, SchedulerRequest
from conveyor.scheduler.swap import SwapSpace


@dataclass(slots=True)
class PrefixMatch:
    """What the caches hold of a request's prefix, found without changing anything."""

    ids: list[int]  # content ids of the matched full blocks (GPU, then CPU)
    gpu_blocks: list[int]  # full blocks on the GPU, in table order
    cpu_blocks: list[int]  # the next full blocks, in the CPU tier
    partial: tuple[int, int] | None  # (cached GPU block, tokens it holds) after them
    num_revived: int  # GPU blocks above that are cached now (taking them uses up available blocks)
    num_tokens: int  # tokens whose KV the match provides


class KVCacheManager:
    """The GPU block pool, the swap space, and the operations on a request's block table."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.index = PrefixIndex()
        self.gpu = BlockPool(config.num_blocks, self.index)
        self.swap = SwapSpace(config.num_cpu_blocks, self.index)
        if config.offload_evicted and self.swap.pool is not None:
            self.gpu.on_evict = self.swap.offload
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens, since start
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ admission

    def match(self, req: SchedulerRequest) -> PrefixMatch:
        """Longest cached prefix of a request that holds no blocks; changes nothing.

        A request still owed prompt log-probabilities matches nothing: they come from the
        prefill's logits, which a cached prefix would skip (it is computed whole, once; its
        blocks are registered for others as usual). So does a pooling request: its vector is
        pooled over the hidden states of every prompt position, which a cached prefix would skip."""
        bs = self.block_size
        if req.sampling.pooling or (
            req.sampling.prompt_logprobs is not None and req.prompt_logprobs_from < req.num_prompt_tokens
        ):
            return PrefixMatch([], [], [], None, 0, 0)
        tokens = req.token_ids
        limit = len(tokens) - 1
        full = limit // bs
        ids = self.index.find_blocks(tokens, full, bs, req.prefix_root)
        gpu = self.gpu.lookup_prefix(ids)  # shared (or revived) ...
        cpu = self.swap.pool.lookup_prefix(ids[len(gpu) :]) if self.swap.pool is not None else []  # ... then swapped in
        del ids[len(gpu) + len(cpu) :]
        num_revived = self.gpu.count_cached(gpu)
        parent = ids[-1] if ids else req.prefix_root
        matched = len(ids)
        partial = None
        start = matched * bs
        if start < limit and not cpu:  # the block after the match may be a cached partial one
            partial = self.gpu.match_partial(parent, tokens[start : min(limit, start + bs)])
            if partial is not None:
                num_revived += 1
        num_tokens = matched * bs + (partial[1] if partial else 0)
        return PrefixMatch(ids, gpu, cpu, partial, num_revived, num_tokens)

    def admission_need(self, req: SchedulerRequest, match: PrefixMatch, extra_tokens: int = 0) -> tuple[int, int]:
        """``(GPU blocks the request needs for all its tokens + extra_tokens, blocks available for it)``."""
        have = len(match.gpu_blocks) + (1 if match.partial else 0)
        need = blocks_for(len(req.token_ids) + extra_tokens, self.block_size) - have
        return need, self.gpu.num_available - match.num_revived

    def admit(self, req: SchedulerRequest, match: PrefixMatch) -> None:
        """Give a request the matched blocks (shared, revived, taken over, or swapped in)."""
        assert not req.block_ids and req.num_computed_tokens == 0
        swap, gpu = self.swap, self.gpu
        for c in match.cpu_blocks:  # first: nothing allocated below may evict them
            swap.hold_for_step(c)
        gpu.acquire_all(match.gpu_blocks)
        if match.partial is not None:
            gpu.take(match.partial[0])
        fresh = gpu.allocate(len(match.cpu_blocks))
        start = len(match.gpu_blocks)
        for k, (c, g) in enumerate(zip(match.cpu_blocks, fresh)):
            swap.swap_in_block(c, g)
            gpu.register(g, match.ids[start + k])
        table = match.gpu_blocks + fresh
        if match.partial is not None:
            table.append(match.partial[0])
        req.block_ids = table
        req.num_computed_tokens = match.num_tokens
        req.block_hashes = list(match.ids)
        req.num_registered_blocks = len(match.ids)
        self.num_queried_tokens += len(req.token_ids) - 1
        self.num_hit_tokens += match.num_tokens

    # ------------------------------------------------------------------ forks (parallel sampling)

    def fork_need(self, req: SchedulerRequest) -> tuple[int, int]:
        """Like :meth:`admission_need` for a sequence forking from its leader (:meth:`fork`):
        the leader's full blocks are shared, everything else is fresh."""
        shared = (req.num_prompt_tokens - 1) // self.block_size
        return blocks_for(len(req.token_ids), self.block_size) - shared, self.gpu.num_available

    def fork(self, req: SchedulerRequest, leader: SchedulerRequest) -> list[list[int]]:
        """Start a never-admitted sequence from its leader's KV of the prompt's first ``P - 1``
        tokens (written, see scheduler/groups.py): a reference to each full block of them,
        and a fresh block for the rest, filled by the returned ``[src, dst]`` copy (none when
        ``P - 1`` is a multiple of the block size). The sequence then runs token ``P - 1``."""
        assert not req.block_ids and req.num_computed_tokens == 0 and req.num_tokens == req.num_prompt_tokens
        computed = req.num_prompt_tokens - 1
        full, rest = divmod(computed, self.block_size)
        table = leader.block_ids[:full]
        self.gpu.acquire_all(table)
        copies = []
        if rest:
            [fresh] = self.gpu.allocate(1)
            copies.append([leader.block_ids[full], fresh])
            table.append(fresh)
        req.block_ids = table
        req.num_computed_tokens = computed
        registered = min(full, leader.num_registered_blocks)
        req.block_hashes = leader.block_hashes[:registered]
        req.num_registered_blocks = registered
        return copies

    # ------------------------------------------------------------------ swapped requests

    def resume_need(self, req: SchedulerRequest, extra_tokens: int = 0) -> tuple[int, int]:
        """Like :meth:`admission_need` for a swapped-out request: CPU blocks whose content is
        back in the GPU cache meanwhile are shared instead of swapped in."""
        need = 0
        revived = 0
        hashes = req.block_hashes
        num_full = req.num_registered_blocks
        for i, _ in req.cpu_blocks:
            block = self.gpu.lookup(hashes[i]) if i < num_full else None
            if block is None:
                need += 1
            elif self.gpu.is_cached(block):
                revived += 1
        need += blocks_for(len(req.token_ids) + extra_tokens, self.block_size) - len(req.block_ids)
        return need, self.gpu.num_available - revived

    def resume(self, req: SchedulerRequest) -> None:
        """Bring a swapped-out request's KV back: share what the GPU cache has, swap in the rest."""
        assert req.status is RequestStatus.SWAPPED
        gpu, swap = self.gpu, self.swap
        hashes = req.block_hashes
        num_full = req.num_registered_blocks
        table = req.block_ids
        missing: list[tuple[int, int]] = []
        for i, c in req.cpu_blocks:  # shares first, so the allocation below cannot evict them
            block = gpu.lookup(hashes[i]) if i < num_full else None
            if block is None:
                missing.append((i, c))
            else:
                gpu.acquire(block)
                table[i] = block
        fresh = gpu.allocate(len(missing))
        for (i, c), g in zip(missing, fresh):
            swap.swap_in_block(c, g)
            table[i] = g
            if i < num_full:
                gpu.register(g, hashes[i])
        swap.release_after_step([c for _, c in req.cpu_blocks])
        req.cpu_blocks = []

    # ------------------------------------------------------------------ growth

    def tokens_that_fit(self, req: SchedulerRequest, want: int) -> int:
        """How many of ``want`` more tokens fit in the request's blocks plus the available ones."""
        capacity = (len(req.block_ids) + self.gpu.num_available) * self.block_size
        return min(want, capacity - req.num_computed_tokens)

    def grow(self, req: SchedulerRequest, num_tokens: int) -> list[int]:
        """Extend the block table to cover ``num_tokens`` tokens; the new blocks (caller checked room)."""
        needed = blocks_for(num_tokens, self.block_size) - len(req.block_ids)
        if needed <= 0:
            return []
        new_blocks = self.gpu.allocate(needed)
        req.block_ids.extend(new_blocks)
        return new_blocks

    def register_full_blocks(self, req: SchedulerRequest, upto: int | None = None) -> None:
        """Make the request's newly completed blocks findable by their content id: those
        within its first ``upto`` tokens (default: its computed ones), which the caller
        knows to be written (not just planned)."""
        bs = self.block_size
        full = (req.num_computed_tokens if upto is None else upto) // bs
        start = req.num_registered_blocks
        if full <= start:
            return
        chain = req.block_hashes
        ids = self.index.intern_blocks(chain[start - 1] if start else req.prefix_root, req.token_ids, start, full, bs)
        self.gpu.register_blocks(req.block_ids[start:full], ids)
        chain.extend(ids)
        req.num_registered_blocks = full

    def invalidate_transfers(
        self, swap_out: list[list[int]], swap_in: list[list[int]], copies: list[list[int]]
    ) -> None:
        """A plan failed, maybe before its copies ran: forget what the blocks those copies
        were to fill are said to hold (a content id, or the tokens of a cached partial block:
        a fork's copy destination, released by its failed sequence), so no later prefix hit
        trusts them."""
        for _, gpu_block in swap_in:
            self.gpu.unregister(gpu_block)
        for _, gpu_block in copies:
            self.gpu.unregister(gpu_block)
        if self.swap.pool is not None:
            for _, cpu_block in swap_out:
                self.swap.pool.unregister(cpu_block)

    # ------------------------------------------------------------------ release

    def exclusive_blocks(self, req: SchedulerRequest) -> int:
        """GPU blocks that only this request holds: what preempting it would give back."""
        refcount = self.gpu.refcount
        return sum(1 for b in req.block_ids if b >= 0 and refcount(b) == 1)

    def blocks_to_swap(self, req: SchedulerRequest) -> int:
        """CPU blocks a swap-out of this running request would take: all its computed ones."""
        return blocks_for(req.num_computed_tokens, self.block_size)

    def free(self, req: SchedulerRequest) -> None:
        """Give back everything the request holds, on the GPU and (if swapped out) on the CPU."""
        if req.cpu_blocks:
            self.swap.release_after_step([c for _, c in req.cpu_blocks])
            req.cpu_blocks = []
        if req.status is RequestStatus.SWAPPED:
            table = []  # its table is all -1: it holds no GPU block
        else:
            self.register_full_blocks(req)
            table = req.block_ids
        req.block_ids = []
        if not table:
            return
        bs = self.block_size
        computed = req.num_computed_tokens
        full, rest = divmod(computed, bs)
        # Released last block first: the LRU then evicts a prefix from its end, and what
        # stays cached is always a usable prefix (a chain is no use without its start).
        if rest and full < len(table):
            partial = table.pop(full)
            self.gpu.free(reversed(table[full:]))
            parent = req.block_hashes[full - 1] if full else req.prefix_root
            self.gpu.free_partial(partial, parent, req.token_ids[full * bs : computed])
            self.gpu.free(reversed(table[:full]))
        else:
            self.gpu.free(reversed(table))

    def swap_out(self, req: SchedulerRequest) -> None:
        """Copy the request's computed blocks to the CPU (planned as swap-out pairs) and give
        back all its GPU blocks. The caller checked room (:meth:`blocks_to_swap`).

        Blocks shared with running requests are copied too rather than kept referenced: a
        swapped-out request then holds nothing on the GPU, so when nothing runs the whole
        pool is available and the head of the line always fits. On resume, blocks still on
        the GPU are shared again instead of swapped in (:meth:`resume`).
        """
        self.register_full_blocks(req)
        bs = self.block_size
        computed = req.num_computed_tokens
        num_computed_blocks = blocks_for(computed, bs)
        table = req.block_ids
        full = computed // bs
        hashes = req.block_hashes
        uncomputed = table[num_computed_blocks:]
        kept = table[:num_computed_blocks]
        cpu = self.swap.swap_out_blocks(kept, [hashes[i] if i < len(hashes) else None for i in range(len(kept))])
        gpu = self.gpu
        gpu.free(uncomputed)
        if full < len(kept):  # the partly filled last block: last released, first evicted
            parent = hashes[full - 1] if full else req.prefix_root
            gpu.free_partial(kept[full], parent, req.token_ids[full * bs : computed])
        gpu.free(reversed(kept[:full]))
        req.block_ids = [-1] * len(kept)
        req.cpu_blocks = list(enumerate(cpu))
