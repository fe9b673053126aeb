"""Data-parallel replicas behind one frontend: which scheduler gets each request, and what
each one still owes.

How and why: docs/architecture.md, "Data-parallel replicas in the frontend"."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import zmq
import zmq.asyncio

from conveyor import profiling
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import (
    SEQUENCE_SEPARATOR,
    AbortRequests,
    AddRequest,
    ProcessProfile,
    SchedulerStats,
    TokenOutputs,
)
from conveyor.ipc.transport import ServerAddresses
from conveyor.protocol import replies
from conveyor.runtime.config import replica_process_name

T = TypeVar("T")

# SchedulerStats fields that are not per-replica quantities to add up.
_NOT_SUMMED = frozenset(
    {
        "query_id",
        "iteration_fields",
        "recent_iterations",
        "iteration_token_counts",
        "spec_accepted_per_position",
        "lora_adapters",
    }
)
# Of those, the lists summed entry by entry.
_SUMMED_BY_ENTRY = ("iteration_token_counts", "spec_accepted_per_position")


class Link(Protocol):
    """What the replica set needs of a scheduler link: a typed send."""

    def send(self, msg: Any) -> None: ...


class SchedulerLink:
    """The frontend's two sockets to one replica's scheduler: a PUSH it connects (requests,
    aborts, queries) and a PULL it binds (the scheduler's outputs and answers)."""

    def __init__(self, ctx: zmq.asyncio.Context, addresses: ServerAddresses) -> None:
        self.to_scheduler = transport.socket(ctx, zmq.PUSH, addresses.to_scheduler, bind=False)
        self.from_scheduler = transport.socket(ctx, zmq.PULL, addresses.to_frontend, bind=True)
        # A synchronous view: an awaited send of the asyncio wrapper costs several times a raw
        # one, and ``to_scheduler`` is never polled, so a raw send is safe from anywhere.
        self._raw = zmq.Socket.shadow(self.to_scheduler.underlying)

    def send(self, msg: Any) -> None:
        self._raw.send(codec.encode(msg), copy=False)

    def close(self) -> None:
        self.to_scheduler.close(linger=0)
        self.from_scheduler.close(linger=0)


@dataclass
class Replica:
    """One scheduler + worker pair as the frontend sees it."""

    index: int
    link: Link
    alive: bool = True
    death: str | None = None  # why it died (the error its requests got)
    outstanding: int = 0  # requests it owns: sent, neither finished there nor aborted
    outstanding_prompt_tokens: int = 0  # their prompt lengths, summed
    routed: int = 0  # requests sent to it since the start
    last_pick: int = -1  # when it was last picked (the tie-break: least recently first)


class ReplicaSet:
    """The replicas behind this frontend: routing, ownership and liveness (docs/architecture.md,
    "Data-parallel replicas in the frontend").

    ``max_sessions`` bounds the remembered placements of finished requests, as the
    frontend's sessions bound their contexts."""

    def __init__(self, links: Sequence[Link], max_sessions: int) -> None:
        if not links:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = [Replica(index, link) for index, link in enumerate(links)]
        self._owners: dict[str, tuple[Replica, int]] = {}  # scheduler id -> (owner, prompt tokens)
        # An owned n > 1 request's id -> its sequences the replica has not finished yet.
        self._sequences_left: dict[str, int] = {}
        # session key -> the replica its latest turn went to, least recently routed first
        self._placements: OrderedDict[Hashable, int] = OrderedDict()
        self._max_sessions = max_sessions
        self._picks = itertools.count()

    def __len__(self) -> int:
        return len(self.replicas)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def owner(self, scheduler_id: str) -> Replica | None:
        """The replica that holds ``scheduler_id`` now (None: finished, aborted or never sent)."""
        entry = self._owners.get(scheduler_id)
        return entry[0] if entry is not None else None

    def submit(self, add: AddRequest, session: Hashable, *, continuing: bool) -> Replica | None:
        """Send ``add`` to the replica it belongs on and record it there; None when no replica
        is alive (bin/serve is then stopping the server, whose Shutdown fails the request).

        ``session`` names the request's conversation (the key its context is remembered
        under); ``continuing``: it continues an earlier turn, whose replica it goes back to."""
        replica = self._route(session, continuing)
        if replica is None:
            return None
        num_tokens = len(add.prompt_token_ids)
        self._owners[add.request_id] = (replica, num_tokens)
        if add.sampling.n > 1:
            self._sequences_left[add.request_id] = add.sampling.n
        replica.outstanding += 1
        replica.outstanding_prompt_tokens += num_tokens
        replica.routed += 1
        replica.last_pick = next(self._picks)
        placements = self._placements
        placements[session] = replica.index
        placements.move_to_end(session)
        while len(placements) > self._max_sessions:
            placements.popitem(last=False)
        replica.link.send(add)
        return replica

    def _route(self, session: Hashable, continuing: bool) -> Replica | None:
        if continuing:
            index = self._placements.get(session)
            if index is not None and self.replicas[index].alive:
                return self.replicas[index]
        live = self.live()
        if not live:
            return None
        return min(live, key=lambda r: (r.outstanding, r.outstanding_prompt_tokens, r.last_pick))

    def abort(self, scheduler_ids: Iterable[str]) -> None:
        """Abort requests at the replicas that hold them, one AbortRequests per replica; ids
        no replica holds (finished there already) are dropped."""
        by_replica: dict[int, list[str]] = {}
        for scheduler_id in scheduler_ids:
            entry = self._owners.pop(scheduler_id, None)
            if entry is not None:
                self._sequences_left.pop(scheduler_id, None)
                self._release(*entry)
            else:  # a sequence of an n > 1 request: it goes where its request is; its finish releases
                parent = _parent_id(scheduler_id)
                entry = self._owners.get(parent) if parent is not None else None
                if entry is None:
                    continue
            by_replica.setdefault(entry[0].index, []).append(scheduler_id)
        for index, ids in by_replica.items():
            self.replicas[index].link.send(AbortRequests(ids))

    def on_outputs(self, msg: TokenOutputs) -> None:
        """A replica's step outputs: the requests it finished (their RequestOutputs with a
        finish reason; the plain next-token columns never finish one) no longer count there."""
        owners = self._owners
        for output in msg.outputs:
            if output.finish_reason is not None:
                rid = output.request_id
                if rid not in owners:  # a sequence's finish: its request's, once all finished
                    rid = _parent_id(rid)
                    if rid is None or rid not in self._sequences_left:
                        continue
                    self._sequences_left[rid] -= 1
                    if self._sequences_left[rid]:
                        continue
                self._sequences_left.pop(rid, None)
                entry = owners.pop(rid, None)
                if entry is not None:
                    self._release(*entry)

    def _release(self, replica: Replica, num_tokens: int) -> None:
        replica.outstanding -= 1
        replica.outstanding_prompt_tokens -= num_tokens

    def fail(self, index: int, reason: str) -> list[str]:
        """Replica ``index`` died: mark it dead and return the scheduler ids it held, for the
        caller to fail (their KV died with the replica; nothing is sent there again)."""
        replica = self.replicas[index]
        replica.alive = False
        replica.death = reason
        held = [scheduler_id for scheduler_id, (owner, _) in self._owners.items() if owner is replica]
        for scheduler_id in held:
            del self._owners[scheduler_id]
            self._sequences_left.pop(scheduler_id, None)
        replica.outstanding = replica.outstanding_prompt_tokens = 0
        return held

    def broadcast(self, msg: Any) -> set[int]:
        """Send ``msg`` to every live replica; the indices it went to."""
        sent = set()
        for replica in self.live():
            replica.link.send(msg)
            sent.add(replica.index)
        return sent


@dataclass
class Gather(Generic[T]):
    """One query's answers from the replicas it was sent to, until each answered or died."""

    waiting: set[int]
    answers: dict[int, T] = field(default_factory=dict)

    def add(self, index: int, answer: T) -> bool:
        """Record replica ``index``'s answer; True when none is missing any more."""
        if index in self.waiting:
            self.waiting.discard(index)
            self.answers[index] = answer
        return not self.waiting

    def drop(self, index: int) -> bool:
        """Replica ``index`` died and will not answer; True when none is missing any more."""
        self.waiting.discard(index)
        return not self.waiting


def merge_stats(answers: dict[int, SchedulerStats]) -> SchedulerStats:
    """The server's stats from its live replicas' (replica index -> its stats): every count
    and block figure summed (the iteration-token histograms bucket by bucket, the accepted
    tokens per position entry by entry), the LoRA adapters those every replica holds (a
    request may go to any), the recent iterations of all of them in time order, each row
    with one more field, ``replica``, the replica whose step it was (its other fields are that
    replica's own). One replica's stats are returned as they are."""
    if len(answers) == 1:
        return next(iter(answers.values()))
    ordered = [answers[index] for index in sorted(answers)]
    first = ordered[0]
    summed = {
        name: sum(getattr(stats, name) for stats in ordered)
        for name in first.__struct_fields__
        if name not in _NOT_SUMMED
    }
    rows = [[*row, index] for index in sorted(answers) for row in answers[index].recent_iterations]
    if "time" in first.iteration_fields:
        time_column = first.iteration_fields.index("time")
        rows.sort(key=lambda row: row[time_column])
    for name in _SUMMED_BY_ENTRY:
        summed[name] = [sum(column) for column in zip(*(getattr(stats, name) for stats in ordered))]
    everywhere = [name for name in first.lora_adapters if all(name in stats.lora_adapters for stats in ordered)]
    return SchedulerStats(
        query_id=first.query_id, iteration_fields=[*first.iteration_fields, "replica"], recent_iterations=rows,
        lora_adapters=everywhere, **summed,
    )  # fmt: skip


def replica_stats(replicas: ReplicaSet, answers: dict[int, SchedulerStats]) -> list[dict[str, Any]]:
    """Each replica's entry of the ``stats`` reply's ``replicas`` list: its index, whether it
    is alive, the frontend's count of requests it holds (``in_flight``) and has been sent
    (``routed``), and its own stats (the fields of the ``stats`` reply; its iterations are in
    the reply's, tagged with their replica); a dead replica's entry has ``error`` (why it
    died) instead of stats."""
    entries = []
    for replica in replicas.replicas:
        entry: dict[str, Any] = {"replica": replica.index, "alive": replica.alive, "routed": replica.routed}
        stats = answers.get(replica.index)
        if stats is not None:
            own = replies.stats_reply(stats, replica.outstanding, iterations=False)
            entry.update((k, v) for k, v in own.items() if k not in ("type", "v"))
        else:
            entry["in_flight"] = replica.outstanding
        if replica.death is not None:
            entry["error"] = replica.death
        entries.append(entry)
    return entries


def replica_profiles(answers: dict[int, list[ProcessProfile]]) -> list[dict[str, Any]]:
    """The replicas' process snapshots as ``profile`` reply entries, replica by replica, each
    process named as bin/serve names it (``scheduler`` for replica 0, ``scheduler.1`` ...)."""
    processes = []
    for index in sorted(answers):
        for snapshot in answers[index]:
            entry = profiling.profile_to_map(snapshot)
            entry["process"] = replica_process_name(snapshot.process, index)
            processes.append(entry)
    return processes


def _parent_id(scheduler_id: str) -> str | None:
    """The request id of a sequence's scheduler id (``{id}/{i}``), or None for a request's own."""
    head, sep, _ = scheduler_id.rpartition(SEQUENCE_SEPARATOR)
    return head if sep else None
