"""The scheduler's state: the one object every phase of an iteration receives.

:class:`~conveyor.scheduler.scheduler.Scheduler` is the protocol with its caller (intake,
``schedule()``, ``update()``, introspection); the phases (planning, admission, preemption,
results, invariants) are functions of a :class:`SchedulerState`, which holds everything they
read or change and nothing else: the waiting line and the running batch, the KV bookkeeping,
the slots and their columns, the plans in flight and whether the plan being formed is planned
ahead. What it keeps true between calls is listed on the Scheduler's class docstring.

Each running request's hot counters (``num_computed_tokens``, the known-token count) live in
the slot columns while it holds a slot (:mod:`~conveyor.scheduler.slot_columns`), in the
request while it does not; the columns alone move them across (``take_slot`` /
``release_slot`` here), and the known count changes only with the token list it mirrors
(:meth:`~conveyor.scheduler.slot_columns.SlotColumns.append_sampled`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from conveyor.ipc.messages import RequestOutput, StepPlan
from conveyor.runtime.config import Preemption, SchedulerConfig
from conveyor.scheduler.kv_manager import KVCacheManager
from conveyor.scheduler.policy import SchedulingPolicy
from conveyor.scheduler.queue import WaitingQueue
from conveyor.scheduler.request import RequestStatus, SchedulerRequest, SeqGroup
from conveyor.scheduler.request_table import RequestTable
from conveyor.scheduler.slot_columns import SlotColumns
from conveyor.scheduler.step import Step

# Plans in flight at once: the one the worker runs and the one planned ahead.
MAX_PLANS_IN_FLIGHT = 2


@dataclass(eq=False, slots=True)
class InFlight:
    """A plan sent and not yet applied, with its :class:`Step` (which request each row was
    planned for). ``sent_ns`` is the caller's: the process loop notes when it sent the plan,
    to time its round trip."""

    plan: StepPlan
    step: Step
    sent_ns: int = 0


class PlansInFlight:
    """The plans formed and not yet applied, oldest first: the one tracker of them (the
    scheduler's phases read it, the process loop waits on its oldest)."""

    __slots__ = ("_plans",)

    def __init__(self) -> None:
        self._plans: deque[InFlight] = deque()

    def __len__(self) -> int:
        return len(self._plans)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._plans)

    @property
    def oldest(self) -> InFlight:
        return self._plans[0]

    @property
    def newest(self) -> InFlight:
        return self._plans[-1]

    def add(self, plan: StepPlan, step: Step) -> None:
        if len(self._plans) >= MAX_PLANS_IN_FLIGHT:
            raise RuntimeError(f"schedule() with {len(self._plans)} plans in flight: update() the oldest first")
        self._plans.append(InFlight(plan, step))

    def pop_oldest(self, plan: StepPlan) -> Step:
        """Take ``plan`` off the line (it must be the oldest); its step."""
        if not self._plans or plan is not self._plans[0].plan:
            raise ValueError(f"update() for step {plan.step_id}, which is not the oldest plan in flight")
        return self._plans.popleft().step


@dataclass(eq=False)
class SchedulerState:
    """What the phases share (module docstring).

    ``free_slots`` are popped from the end: the lowest first, and the one given back last is
    reused first, which keeps the worker's slot table short. ``finished_slots`` are slots given
    back whose request the worker must drop, sent with the next plan formed. ``ahead``: the plan
    being formed is planned ahead of one in flight; ``declined``: the last plan ahead stopped
    short of something only a plan in sync may do (a preemption).
    """

    config: SchedulerConfig
    eos_token_ids: frozenset[int]
    vocab_size: int | None
    clock: Callable[[], float]
    policy: SchedulingPolicy
    kv: KVCacheManager
    queue: WaitingQueue = field(default_factory=WaitingQueue)
    table: RequestTable = field(default_factory=RequestTable)
    inflight: PlansInFlight = field(default_factory=PlansInFlight)
    cols: SlotColumns = field(init=False)
    free_slots: list[int] = field(init=False)
    finished_slots: list[int] = field(default_factory=list)
    # Parallel-sampling requests by id, while a sequence of them lives; those with held
    # sequences (scheduler/groups.py).
    groups: dict[str, SeqGroup] = field(default_factory=dict)
    forking: list[SeqGroup] = field(default_factory=list)
    ahead: bool = False
    declined: bool = False
    # Speculative decoding counters (scheduler/results.py): rows that verified a proposal,
    # tokens proposed, proposed tokens accepted, accepted ones by position in their proposal
    # (entry i: proposals whose first i + 1 tokens were accepted), steps that verified any;
    # and steps the batch-size rule kept from proposing (scheduler/speculation.py).
    spec_num_proposals: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(init=False)
    spec_num_steps: int = 0
    spec_num_limited_steps: int = 0
    num_preemptions: dict[Preemption, int] = field(
        default_factory=lambda: {Preemption.SWAP: 0, Preemption.RECOMPUTE: 0}
    )

    def __post_init__(self) -> None:
        n = self.config.max_num_seqs
        self.cols = SlotColumns(n, self.eos_token_ids)
        self.spec_accepted_per_position = [0] * self.config.speculative_tokens
        self.free_slots = list(range(n - 1, -1, -1))

    @classmethod
    def new(
        cls, config: SchedulerConfig, eos_token_ids: frozenset[int], vocab_size: int | None, clock: Callable[[], float]
    ) -> SchedulerState:
        return cls(config, eos_token_ids, vocab_size, clock, SchedulingPolicy(config), KVCacheManager(config))

    def done_tokens(self, req: SchedulerRequest) -> int:
        """``num_computed_tokens`` minus what the plans still in flight compute for ``req``:
        the tokens whose KV is known to be written."""
        done = req.num_computed_tokens
        for entry in self.inflight:
            done -= entry.step.tokens_of(req, self.cols)
        return done

    def finish(
        self,
        req: SchedulerRequest,
        reason: str,
        *,
        error: str | None = None,
        new_token_ids: list[int] | None = None,
        done: int | None = None,
    ) -> RequestOutput:
        """Retire ``req`` (caller removes it from running/waiting) and build its last output.

        With plans in flight, its computed count is first cut back to ``done`` (default: what
        the plans already applied computed), so that only KV known to be written goes to the
        prefix cache (and no pending token is counted)."""
        if done is not None or self.inflight:
            req.num_computed_tokens = self.done_tokens(req) if done is None else done
        self.kv.free(req)
        self.release_slot(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.table.forget(req)
        group = req.group
        if group is not None:
            if req in group.held:  # (a held sequence aborted: never queued)
                group.held.remove(req)
            group.num_live -= 1
            if not group.num_live:
                del self.groups[group.request_id]
        return RequestOutput(
            req.request_id,
            new_token_ids if new_token_ids is not None else [],
            reason,
            error,
            req.scheduled_time,
            req.first_token_time,
            req.num_cached_tokens,
        )

    def take_slot(self, req: SchedulerRequest) -> None:
        """Give ``req`` a free slot (one exists: it is not running, and fewer than
        ``max_num_seqs`` are); its hot counters move into the slot columns."""
        slot = self.free_slots.pop()
        self.cols.assign(req, slot, eos_stops=not req.sampling.ignore_eos)
        req.columns = self.cols
        req.slot = slot

    def release_slot(self, req: SchedulerRequest) -> None:
        """Give ``req``'s slot back, if it holds one: free for the next admission at once, and
        queued for the worker to drop with the next plan (which drops before it adds)."""
        slot = req.slot
        if slot >= 0:
            self.cols.release(req, slot)
            self.finished_slots.append(slot)
            self.free_slots.append(slot)
            req.slot = -1
