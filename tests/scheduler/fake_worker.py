"""A worker stand-in that executes StepPlans the way the real worker must, and checks them.

It keeps what the real model runner keeps per request (token list, block table, computed
count), by slot as the real one does, and asserts every rule of the plan protocol in
``conveyor.ipc.messages`` (slots included: a new request only on a free slot, after the
plan's drops; cached rows only on held slots), so a scheduler bug shows up as an
AssertionError at the step that broke the rule.

It also models the KV cache's *contents*: every slot of every GPU and CPU block holds the
identity of the prefix whose KV it would contain (a chained hash of the tokens up to that
position), written when a step computes a token and copied by swaps. Before a request runs,
every slot it relies on (its first ``num_computed`` positions) must hold exactly its own
prefix: that checks prefix-cache hits, partial-block takeovers, swap-outs and swap-ins the
way wrong KV would show in real outputs. A write into a slot another live request relies on
is refused (sharing is read-only), as is a swap-in over a block someone holds.

Sampled tokens are a pure function of (request id, position), so a request produces the
same tokens whatever it is batched with and however often it is preempted or resumed.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.ipc.messages import StepPlan, StepResult
from tests import plans


def default_token(request_id: str, position: int, low: int = 1, high: int = 1000) -> int:
    """A deterministic token in ``[low, high)`` for the token at ``position`` of a request."""
    return low + zlib.crc32(f"{request_id}:{position}".encode()) % (high - low)


def pooled_vector(tokens: list[int]) -> bytes:
    """The fake worker's vector of a pooling request: its prompt's length and sum, float32."""
    return struct.pack("<2f", len(tokens), sum(tokens))


@dataclass
class _State:
    request_id: str
    tokens: list[int]
    blocks: list[int]
    computed: int
    idents: list[int] = field(default_factory=list)
    pooling: bool = False  # a pooling request: pooled (pooled_vector) when its prompt is computed, never sampled

    def ident(self, position: int) -> int:
        """The identity of the prefix ``tokens[:position + 1]`` (what its KV slot must hold)."""
        while len(self.idents) <= position:
            prev = self.idents[-1] if self.idents else 0
            self.idents.append(hash((prev, self.tokens[len(self.idents)])))
        return self.idents[position]


@dataclass
class FakeWorker:
    """Executes plans with the real worker's bookkeeping and checks them.

    ``eos_at`` maps a request id to the absolute token position (index into prompt +
    outputs) at which the worker samples ``eos_token_id`` instead of the default token.
    ``token_fn`` overrides the default token entirely. ``fail_steps`` makes those step ids
    return an error result without advancing anything. ``max_num_seqs`` and
    ``max_num_batched_tokens``, when given, are checked against every plan.
    """

    block_size: int
    num_blocks: int | None = None
    eos_token_id: int = 0
    eos_at: dict[str, int] = field(default_factory=dict)
    token_fn: Callable[[str, int], int] | None = None
    fail_steps: set[int] = field(default_factory=set)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_cpu_blocks: int = 0

    def __post_init__(self) -> None:
        self.state: dict[int, _State] = {}  # slot -> the request on it
        self.holders: dict[int, set[int]] = {}  # GPU block -> slots whose table names it
        self.gpu: dict[int, list[int | None]] = {}  # block -> slot contents
        self.cpu: dict[int, list[int | None]] = {}
        self.last_step_id = 0
        self.plans: list[StepPlan] = []
        # step id -> {request id: tokens scheduled}
        self.scheduled: list[dict[str, int]] = []
        self.num_computed_at_arrival: dict[str, list[int]] = {}  # request id -> per NewRequestData
        self.num_tokens_computed = 0
        self.last_failed = False  # the last step failed: a plan planned ahead of it fails too
        self.num_block_copies = 0
        self.never_taken: set[int] = set()  # slots given in plans failed unrun, not dropped since

    def token_for(self, request_id: str, position: int) -> int:
        if self.eos_at.get(request_id) == position:
            return self.eos_token_id
        if self.token_fn is not None:
            return self.token_fn(request_id, position)
        return default_token(request_id, position)

    def expected_outputs(self, request_id: str, prompt_len: int, n: int) -> list[int]:
        """The first ``n`` outputs this worker produces for a request run alone."""
        return [self.token_for(request_id, prompt_len + i) for i in range(n)]

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step_id > self.last_step_id, f"step id {plan.step_id} not increasing"
        self.last_step_id = plan.step_id
        self.plans.append(plan)
        bs = self.block_size

        finished = list(plan.finished_slots)
        assert len(set(finished)) == len(finished), f"step {plan.step_id} drops a slot twice: {finished}"
        for slot in finished:
            # A request first sent in a plan that failed unrun (below) was never taken in.
            assert slot in self.state or slot in self.never_taken, f"finished slot {slot} is not held by the worker"
            if slot in self.state:
                self._drop(slot)
            self.never_taken.discard(slot)
        failed_before, self.last_failed = self.last_failed, plan.step_id in self.fail_steps
        if plan.planned_ahead and failed_before:
            # Built on a step that failed: the real worker fails it unrun, as here.
            self.last_failed = True
            for new in plan.new_requests:
                assert new.slot not in self.state, f"new request {new.request_id!r} on held slot {new.slot}"
                self.never_taken.add(new.slot)
            return StepResult(plan.step_id, [], [], error=f"step {plan.step_id} was planned ahead of a failed step")

        # Copies, in the real worker's order: all swap-outs, all swap-ins, then the forks'
        # block copies, before anything is computed. A failing step fails before them: the
        # scheduler must not trust what they were to copy.
        failing = plan.step_id in self.fail_steps
        outs = [d for _, d in plan.swap_out]
        assert len(set(outs)) == len(outs), f"swap-out destinations repeat: {plan.swap_out}"
        ins = [d for _, d in plan.swap_in]
        assert len(set(ins)) == len(ins), f"swap-in destinations repeat: {plan.swap_in}"
        for g, c in plan.swap_out:
            self._check_gpu_id(g)
            assert 0 <= c < self.num_cpu_blocks, f"CPU block {c} outside the swap space"
            if not failing:
                self.cpu[c] = list(self.gpu.get(g, [None] * bs))
        for c, g in plan.swap_in:
            self._check_gpu_id(g)
            assert failing or c in self.cpu, f"swap-in from CPU block {c}, which was never written"
            assert not self.holders.get(g), f"swap-in over block {g}, held by slots {self.holders.get(g)}"
            self.gpu[g] = [None] * bs if failing else list(self.cpu[c])
        dsts = [d for _, d in plan.copy_blocks]
        assert len(set(dsts)) == len(dsts), f"copy destinations repeat: {plan.copy_blocks}"
        assert not set(dsts) & {s for s, _ in plan.copy_blocks}, f"a copy destination is a source: {plan.copy_blocks}"
        for src, dst in plan.copy_blocks:
            self._check_gpu_id(src)
            self._check_gpu_id(dst)
            assert not self.holders.get(dst), f"copy over block {dst}, held by slots {self.holders.get(dst)}"
            self.num_block_copies += 1
            self.gpu[dst] = [None] * bs if failing else list(self.gpu.get(src, [None] * bs))

        cached = plans.rows(plan.cached_requests)
        spec_rows = plan.cached_requests.spec_rows
        assert spec_rows == sorted(set(spec_rows)), f"spec rows not increasing: {spec_rows}"
        proposals = {cached[row].slot: list(p) for row, p in zip(spec_rows, plan.cached_requests.spec_token_ids)}
        slots_in_plan = [r.slot for r in plan.new_requests] + [r.slot for r in cached]
        assert slots_in_plan, "empty plan"
        assert len(set(slots_in_plan)) == len(slots_in_plan), f"a slot appears twice in step {plan.step_id}"
        if self.max_num_seqs is not None:
            assert len(slots_in_plan) <= self.max_num_seqs
            assert all(0 <= slot < self.max_num_seqs for slot in slots_in_plan), f"slots out of range: {slots_in_plan}"
        total = sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(r.num_scheduled_tokens for r in cached)
        if self.max_num_batched_tokens is not None:
            assert total <= self.max_num_batched_tokens, f"{total} tokens over budget"

        work: list[tuple[int, int]] = []  # (slot, known tokens scheduled: a proposal's are not)
        for new in plan.new_requests:
            rid, slot = new.request_id, new.slot
            held = self.state.get(slot)
            assert held is None, f"new request {rid!r} on slot {slot}, held by {held.request_id!r}"
            assert rid not in {st.request_id for st in self.state.values()}, f"request {rid!r} is already held"
            assert new.token_ids, f"{rid!r} has no tokens"
            assert 0 <= new.num_computed_tokens < len(new.token_ids)
            assert len(new.block_ids) * bs >= new.num_computed_tokens
            self._claim(slot, new.block_ids)
            # A pooling request's chunks are pooled here in order from its first token: it takes
            # no cached prefix and is never resumed from a swap (the real worker's sum would be lost).
            assert not new.sampling.pooling or new.num_computed_tokens == 0, f"{rid!r} pools but arrives computed"
            self.state[slot] = _State(
                rid,
                list(new.token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                pooling=bool(new.sampling.pooling),
            )
            self.num_computed_at_arrival.setdefault(rid, []).append(new.num_computed_tokens)
            work.append((slot, new.num_scheduled_tokens))
        for row in cached:
            slot = row.slot
            assert slot in self.state, f"cached row on slot {slot}, which holds no request"
            st = self.state[slot]
            assert row.num_computed_tokens == st.computed, (
                f"{st.request_id!r}: plan says {row.num_computed_tokens} computed, worker has {st.computed}"
            )
            self._claim(slot, row.new_block_ids)
            st.blocks.extend(row.new_block_ids)
            proposal = proposals.get(slot)
            if proposal is not None:
                assert proposal and row.num_scheduled_tokens == 1 + len(proposal), (
                    f"{st.request_id!r}: {row.num_scheduled_tokens} scheduled for a proposal of {len(proposal)}"
                )
                assert st.computed + 1 == len(st.tokens), f"{st.request_id!r}: a speculative row is not a decode"
                assert len(st.blocks) * bs >= len(st.tokens) + len(proposal), (
                    f"{st.request_id!r}: no blocks for its proposal"
                )
            work.append((slot, 1 if proposal is not None else row.num_scheduled_tokens))

        self.scheduled.append({self.state[slot].request_id: n for slot, n in work})
        if plan.step_id in self.fail_steps:
            # Fails after taking the plan's requests in (so the scheduler's later
            # finished_slots name requests it holds) but before advancing any.
            return StepResult(plan.step_id, [], [], error=f"injected failure at step {plan.step_id}")
        for slot, n in work:  # every request reads its cached prefix before anyone writes
            self._check_prefix(slot)
        slots: list[int] = []
        sampled: list[int] = []
        spec_slots: list[int] = []
        spec_tokens: list[list[int]] = []
        pooled_slots: list[int] = []
        pooled: list[bytes] = []
        for slot, n in work:
            st = self.state[slot]
            rid = st.request_id
            assert n >= 1, f"{rid!r}: {n} tokens scheduled"
            assert st.computed + n <= len(st.tokens), (
                f"{rid!r}: {st.computed} + {n} scheduled > {len(st.tokens)} known tokens"
            )
            assert len(st.blocks) * bs >= st.computed + n, (
                f"{rid!r}: {len(st.blocks)} blocks do not cover {st.computed + n} tokens"
            )
            for p in range(st.computed, st.computed + n):
                self._write(slot, st, p)
            st.computed += n
            self.num_tokens_computed += n
            if st.computed == len(st.tokens) and st.pooling:
                pooled_slots.append(slot)
                pooled.append(pooled_vector(st.tokens))
            elif st.computed == len(st.tokens):
                token = self.token_for(rid, len(st.tokens))
                st.tokens.append(token)
                slots.append(slot)
                sampled.append(token)
                if slot in proposals:
                    spec_slots.append(slot)
                    spec_tokens.append(self._verify(slot, st, proposals[slot]))
        return StepResult(
            plan.step_id,
            slots,
            sampled,
            spec_slots=spec_slots,
            spec_token_ids=spec_tokens,
            pooled_slots=pooled_slots,
            pooled=pooled,
        )

    def _verify(self, slot: int, st: _State, proposal: list[int]) -> list[int]:
        """Greedy verification, as the real worker's: the proposal's tokens are kept while each
        equals the token this worker produces there, then the one it produces at the first
        mismatch (or after the whole proposal) is added; their KV is written (a rejected
        token's is not: the real worker's lies past the computed count, never read)."""
        gained: list[int] = []
        for token in proposal:
            if token != st.tokens[-1]:
                break
            self._write(slot, st, st.computed)
            st.computed += 1
            self.num_tokens_computed += 1
            st.tokens.append(self.token_for(st.request_id, len(st.tokens)))
            gained.append(st.tokens[-1])
        return gained

    # -------------------------------------------------------------- KV contents

    def _check_prefix(self, slot: int) -> None:
        st = self.state[slot]
        bs = self.block_size
        for p in range(st.computed):
            got = self.gpu.get(st.blocks[p // bs], [None] * bs)[p % bs]
            assert got == st.ident(p), (
                f"{st.request_id!r}: KV slot of position {p} (block {st.blocks[p // bs]}) holds another prefix"
            )

    def _write(self, slot: int, st: _State, position: int) -> None:
        bs = self.block_size
        block = st.blocks[position // bs]
        for other in self.holders.get(block, ()):
            if other == slot:
                continue
            ost = self.state[other]
            index = ost.blocks.index(block)
            assert index * bs + position % bs >= ost.computed, (
                f"{st.request_id!r} writes slot {position % bs} of block {block}, which {ost.request_id!r} relies on"
            )
        self.gpu.setdefault(block, [None] * bs)[position % bs] = st.ident(position)

    # -------------------------------------------------------------- ownership

    def _check_gpu_id(self, block: int) -> None:
        if self.num_blocks is not None:
            assert 0 <= block < self.num_blocks, f"block {block} outside the cache"

    def _claim(self, slot: int, blocks: list[int]) -> None:
        assert len(set(blocks)) == len(blocks), f"slot {slot} given a block twice: {blocks}"
        for b in blocks:
            self._check_gpu_id(b)
            self.holders.setdefault(b, set()).add(slot)

    def _drop(self, slot: int) -> None:
        for b in self.state.pop(slot).blocks:
            holders = self.holders[b]
            holders.discard(slot)
            if not holders:
                del self.holders[b]
