"""The worker's check of each plan against what it holds: its trust boundary with the scheduler.

Requests were validated before they reached the scheduler (:mod:`conveyor.protocol.requests` and
:mod:`conveyor.protocol.validation`: the frontend, and the scheduler at its own entry for in-process
callers); the worker does not repeat those request rules. What it checks is the plan itself, because
a plan that contradicts the worker's state would make the device read or write KV out of bounds or
of another request: slots in range, new requests only on free slots and cached rows only on held
ones, each slot once, counts that agree with the worker's, token ranges within what is known, block
ids inside the pool, block tables long enough, swap pairs inside the caches, and at most
``max_num_seqs`` rows. A plan that fails is refused (:class:`PlanRefused`) before any state changes,
apart from dropping its finished slots, which comes first.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.ipc.messages import MAX_SLOTS, StepPlan, int_list
from conveyor.worker.request_state import RequestState, Work


class PlanRefused(ValueError):
    """A plan the runner refuses before it changes any state or runs anything on the device
    (it contradicts the runner's state, or was planned ahead of a step that failed). Raised
    alike on every tensor-parallel rank, before any collective, so the ranks stay in step and
    only that step fails; any other error of a rank leaves the ranks out of step."""


@dataclass(frozen=True)
class PlanChecker:
    """The bounds a plan must keep: the KV pool (``num_blocks`` of ``block_size`` tokens),
    the swap space (``num_cpu_blocks``) and the rows of a step (``max_num_seqs``)."""

    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int

    @staticmethod
    def check_dropped(slots: list[int]) -> None:
        """A plan's ``finished_slots`` are in the range a scheduler hands out."""
        bad = [slot for slot in slots if not 0 <= slot < MAX_SLOTS]
        if bad:
            raise PlanRefused(f"finished slots {bad} outside 0..{MAX_SLOTS - 1}")

    def check(self, plan: StepPlan, table: list[RequestState | None], drafts: bool = False) -> list[Work]:
        """The plan's work in order (new requests first), given the request state by slot
        (``table``), or PlanRefused naming the first problem (the slot, and the request id
        where known).

        Runs after ``finished_slots`` are dropped (so a new request may take a slot this plan
        frees, and a cached row may not name one); mutates nothing. ``drafts``: the runner has
        a draft model (else a plan asking for drafted tokens is refused).
        """
        size = len(table)
        seen: dict[int, str] = {}  # slot -> request id, of the rows so far
        work: list[Work] = []

        def twice(slot: int, rid: str) -> PlanRefused:
            return PlanRefused(
                f"slot {slot} appears twice in step {plan.step_id} (request {seen[slot]!r}, then {rid!r})"
            )

        for new in plan.new_requests:
            rid, slot = new.request_id, new.slot
            if not 0 <= slot < MAX_SLOTS:
                raise PlanRefused(f"new request {rid!r}: slot {slot} outside 0..{MAX_SLOTS - 1}")
            if slot in seen:
                raise twice(slot, rid)
            seen[slot] = rid
            holder = table[slot] if slot < size else None
            if holder is not None:
                raise PlanRefused(
                    f"new request {rid!r} on slot {slot}, which request {holder.request_id!r} still holds on the worker"
                )
            self._check_blocks(rid, slot, new.block_ids)
            self._check_tokens(
                rid, slot, new.num_computed_tokens, new.num_scheduled_tokens, len(new.token_ids), len(new.block_ids)
            )
            work.append(Work(slot, new.num_computed_tokens, new.num_scheduled_tokens, []))
        cached = plan.cached_requests
        new_blocks = dict(zip(cached.new_block_rows, cached.new_block_ids))
        proposals = {row: tuple(int_list(p)) for row, p in zip(cached.spec_rows, cached.spec_token_ids)}
        drafted = dict(zip(cached.spec_rows, cached.spec_draft_counts))
        if drafted and not drafts:
            raise PlanRefused(f"step {plan.step_id} asks for drafted tokens, but this runner has no draft model")
        for row, (slot, num_computed, num_scheduled) in enumerate(
            zip(int_list(cached.slots), int_list(cached.num_computed_tokens), int_list(cached.num_scheduled_tokens))
        ):
            state = table[slot] if 0 <= slot < size else None
            if slot in seen:
                raise twice(slot, state.request_id if state is not None else "?")
            if state is None:
                raise PlanRefused(f"unknown slot {slot} (row {row}): no request on it is running on the worker")
            rid = state.request_id
            seen[slot] = rid
            if num_computed != state.num_computed:
                raise PlanRefused(
                    f"request {rid!r} (slot {slot}): num_computed_tokens mismatch: plan says {num_computed}, "
                    f"worker has {state.num_computed}"
                )
            blocks = new_blocks.get(row, [])
            if blocks:
                self._check_blocks(rid, slot, blocks)
            proposal, num_drafted = proposals.get(row, ()), drafted.get(row, 0)
            proposed = len(proposal) or num_drafted
            if proposed and (
                num_scheduled != 1 + proposed
                or num_computed + 1 != state.num_known
                or state.pending
                or plan.planned_ahead
            ):
                raise PlanRefused(
                    f"request {rid!r} (slot {slot}): a speculative row must run its last known token, all of it "
                    f"on the host, and its {proposed} proposed tokens, in a plan not planned ahead"
                )
            self._check_tokens(
                rid, slot, num_computed, num_scheduled, state.num_known + proposed, len(state.block_ids) + len(blocks)
            )
            work.append(Work(slot, num_computed, num_scheduled, list(blocks), proposal, 0 if proposal else num_drafted))
        if len(work) > self.max_num_seqs:
            raise PlanRefused(
                f"step {plan.step_id} runs {len(work)} requests; this runner takes at most {self.max_num_seqs}"
            )
        self._check_transfers(plan)
        return work

    def _check_transfers(self, plan: StepPlan) -> None:
        for name, pairs, src_limit, dst_limit in (
            ("swap_out", plan.swap_out, self.num_blocks, self.num_cpu_blocks),
            ("swap_in", plan.swap_in, self.num_cpu_blocks, self.num_blocks),
        ):
            for pair in pairs:
                if len(pair) != 2 or not (0 <= pair[0] < src_limit and 0 <= pair[1] < dst_limit):
                    raise PlanRefused(f"{name} pair {pair} outside the caches ({src_limit} -> {dst_limit} blocks)")
            if len({pair[1] for pair in pairs}) != len(pairs):
                raise PlanRefused(f"{name} writes a block twice")
        copies = plan.copy_blocks
        for pair in copies:
            if len(pair) != 2 or not (0 <= pair[0] < self.num_blocks and 0 <= pair[1] < self.num_blocks):
                raise PlanRefused(f"copy_blocks pair {pair} outside the cache of {self.num_blocks} blocks")
        dsts = {pair[1] for pair in copies}
        if len(dsts) != len(copies) or dsts & {pair[0] for pair in copies}:
            raise PlanRefused("copy_blocks writes a block twice, or reads one it writes")

    def _check_tokens(
        self, rid: str, slot: int, num_computed: int, num_scheduled: int, num_tokens: int, num_blocks: int
    ) -> None:
        if num_scheduled < 1 or num_computed < 0:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): invalid counts computed={num_computed} scheduled={num_scheduled}"
            )
        end = num_computed + num_scheduled
        if end > num_tokens:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): schedules up to token {end} but only {num_tokens} tokens are known"
            )
        if num_blocks * self.block_size < end:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): block table too short: "
                f"{num_blocks} blocks of {self.block_size} tokens for {end} tokens"
            )

    def _check_blocks(self, rid: str, slot: int, block_ids: list[int]) -> None:
        """Only ids new to the runner are checked: the rest were checked when they arrived."""
        bad = [block for block in block_ids if not 0 <= block < self.num_blocks]
        if bad:
            raise PlanRefused(
                f"request {rid!r} (slot {slot}): block ids {bad} outside the pool of {self.num_blocks} blocks"
            )
