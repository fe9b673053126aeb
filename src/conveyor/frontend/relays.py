"""The frontend's relays of client queries to every live replica: ``stats``, ``profile``,
``load_lora`` / ``unload_lora`` (and, through :mod:`conveyor.frontend.engine_relay`, an RL
trainer's commands), each answered once every replica asked answered or died (or
on its bound). LoRA updates: one update of a name at a time, and a load answered with an error
is undone on every replica that took it (docs/architecture.md, "LoRA adapters")."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from conveyor import profiling
from conveyor.frontend.engine_relay import EngineRelay
from conveyor.frontend.replicas import Gather, ReplicaSet, merge_stats, replica_profiles, replica_stats
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.sending import ClientSender
from conveyor.ipc.messages import (
    LORA_ALREADY_LOADED,
    LORA_NOT_FOUND,
    EngineControlled,
    LoadLora,
    LoraUpdated,
    ProfileQuery,
    ProfileReport,
    SchedulerStats,
    StatsQuery,
    UnloadLora,
)
from conveyor.protocol import replies, wire
from conveyor.protocol import requests as client_requests

log = logging.getLogger("conveyor.frontend")

PROFILE_TIMEOUT_S = 10.0
# How long a load_lora / unload_lora waits for every replica before the client gets a
# ``timeout`` error naming the silent ones. A load reads the adapter's files off the step loop
# (a GB of safetensors from a slow network disk takes tens of seconds), so the bound is
# generous; it stays under the clients' own wait (client.connection.DEFAULT_TIMEOUT_S, 300 s)
# so they hear why instead of timing out blind.
LORA_UPDATE_TIMEOUT_S = 120.0


@dataclass
class LoraWaiter:
    """A relayed ``load_lora`` / ``unload_lora``: who asked, the replicas' answers, its timer."""

    identity: bytes
    cmd: client_requests.LoraCommand
    gather: Gather[LoraUpdated]
    timeout: asyncio.TimerHandle


class Relays:
    """The queries relayed to the replicas and their answers. ``in_flight``: the frontend's
    requests (a stats reply counts them; an unload refuses while one names the adapter);
    ``profiler``: this process's, whose snapshot leads a profile reply.

    ``lora_owed``: query id -> (a timed-out update, the replicas that have not answered it
    yet); an entry goes when each has answered or died."""

    def __init__(
        self,
        replicas: ReplicaSet,
        sender: ClientSender,
        in_flight: dict[tuple[bytes, str], RequestState],
        profiler: profiling.Profiler,
        enable_lora_loading: bool,
        enable_rl_control: bool = False,
    ) -> None:
        self.replicas = replicas
        self.sender = sender
        self.in_flight = in_flight
        self.profiler = profiler
        self.enable_lora_loading = enable_lora_loading
        self.engine = EngineRelay(replicas, sender, enable_rl_control)  # weight updates, sleep, pause
        # query id -> (client, iterations asked for, the replicas' answers)
        self.stats_waiters: dict[str, tuple[bytes, bool, Gather[SchedulerStats]]] = {}
        # query id -> a load_lora / unload_lora waiting for the replicas; timed-out ones still owed
        self.lora_waiters: dict[str, LoraWaiter] = {}
        self.lora_owed: dict[str, tuple[client_requests.LoraCommand, set[int]]] = {}
        self.profile_waiters: dict[
            str, tuple[bytes, client_requests.ProfileCommand, asyncio.TimerHandle, Gather[list]]
        ] = {}

    def stats(self, identity: bytes, iterations: bool) -> None:
        """Relay a ``stats`` query to every live replica."""
        query_id = uuid.uuid4().hex
        asked = self.replicas.broadcast(StatsQuery(query_id))
        self.stats_waiters[query_id] = (identity, iterations, Gather(asked))

    async def on_answer(self, replica: int, msg) -> None:
        """Replica ``replica``'s answer to a relayed query."""
        if isinstance(msg, ProfileReport):
            waiter = self.profile_waiters.get(msg.query_id)
            if waiter is not None and waiter[3].add(replica, msg.profiles):
                await self._reply_profile(msg.query_id)
        elif isinstance(msg, SchedulerStats):
            waiter = self.stats_waiters.get(msg.query_id)
            if waiter is not None and waiter[2].add(replica, msg):
                await self._reply_stats(msg.query_id)
        elif isinstance(msg, EngineControlled):
            await self.engine.on_answer(replica, msg)
        elif isinstance(msg, LoraUpdated):
            lora = self.lora_waiters.get(msg.query_id)
            if lora is None:
                self._on_late_lora(replica, msg)
            elif lora.gather.add(replica, msg):
                await self._reply_lora(msg.query_id)

    async def replica_gone(self, replica: int) -> None:
        """Replica ``replica`` died: no query waits for it any more."""
        for query_id, waiter in list(self.stats_waiters.items()):
            if waiter[2].drop(replica):
                await self._reply_stats(query_id)
        for query_id, waiter in list(self.profile_waiters.items()):
            if waiter[3].drop(replica):
                await self._reply_profile(query_id)
        for query_id, lora in list(self.lora_waiters.items()):
            if lora.gather.drop(replica):
                await self._reply_lora(query_id)
        await self.engine.replica_gone(replica)
        for query_id, (_, waiting) in list(self.lora_owed.items()):
            waiting.discard(replica)
            if not waiting:
                del self.lora_owed[query_id]

    async def fail_all(self, reason: str) -> None:
        """Answer every query still waiting with ``reason`` as its error (nobody else will)."""
        for query_id in list(self.stats_waiters):
            identity = self.stats_waiters.pop(query_id)[0]
            await self.sender.send(identity, replies.error_map(None, reason, wire.SERVER_ERROR, command=wire.STATS))
        for query_id in list(self.profile_waiters):
            await self._reply_profile(query_id, error=reason)
        for query_id in list(self.lora_waiters):
            waiter = self.lora_waiters.pop(query_id)
            waiter.timeout.cancel()
            await self.sender.send(waiter.identity, replies.error_map(waiter.cmd.request_id, reason, wire.SERVER_ERROR))
        self.lora_owed.clear()
        await self.engine.fail_all(reason)

    async def _reply_stats(self, query_id: str) -> None:
        """The ``stats`` reply once every replica asked answered (or died): their stats merged
        (:func:`merge_stats`), each replica's own under ``replicas``."""
        identity, iterations, gather = self.stats_waiters.pop(query_id)
        if not gather.answers:
            error = replies.error_map(
                None, "no scheduler is alive to answer stats", wire.SERVER_ERROR, command=wire.STATS
            )
            await self.sender.send(identity, error)
            return
        reply = replies.stats_reply(merge_stats(gather.answers), len(self.in_flight), iterations=iterations)
        reply["replicas"] = replica_stats(self.replicas, gather.answers)
        await self.sender.send(identity, reply)

    async def lora(self, identity: bytes, cmd: client_requests.LoraCommand) -> None:
        """Relay a ``load_lora`` / ``unload_lora`` to every live replica's scheduler; refused
        here when the server runs without --enable-lora-loading, and an unload while a request
        in flight here names the adapter (whichever replica runs it, or none yet: still
        tokenizing), so the replicas never part on it."""
        if not self.enable_lora_loading:
            message = "loading and unloading LoRA adapters is off: start bin/serve with --enable-lora-loading"
            await self.sender.send(identity, replies.error_map(cmd.request_id, message, wire.LORA_LOADING_DISABLED))
            return
        users = sum(1 for state in self.in_flight.values() if state.lora == cmd.name)
        if cmd.path is None and users:  # refused here for every replica alike (each also checks its own)
            message = (
                f"LoRA adapter {cmd.name!r} is in use by {users} live request(s): unload it once they finish "
                "(or abort them)"
            )
            await self.sender.send(identity, replies.error_map(cmd.request_id, message, wire.LORA_IN_USE))
            return
        pending = self._lora_pending(cmd.name)
        if pending:
            await self.sender.send(identity, replies.error_map(cmd.request_id, pending, wire.LORA_UPDATE_PENDING))
            return
        query_id = uuid.uuid4().hex
        msg = UnloadLora(query_id, cmd.name) if cmd.path is None else LoadLora(query_id, cmd.name, cmd.path)
        loop = asyncio.get_running_loop()
        timeout = loop.call_later(
            LORA_UPDATE_TIMEOUT_S, lambda: asyncio.ensure_future(self._reply_lora(query_id, timed_out=True))
        )
        self.lora_waiters[query_id] = LoraWaiter(identity, cmd, Gather(self.replicas.broadcast(msg)), timeout)

    def _lora_pending(self, name: str) -> str | None:
        """Why an update of adapter ``name`` must wait (another is unanswered), or None."""
        if any(waiter.cmd.name == name for waiter in self.lora_waiters.values()):
            return f"another load or unload of LoRA adapter {name!r} is in progress: retry once it is answered"
        owing = sorted({index for cmd, waiting in self.lora_owed.values() if cmd.name == name for index in waiting})
        if owing:
            return (
                f"an earlier load or unload of LoRA adapter {name!r} timed out and replica(s) {owing} have "
                "not answered it yet: retry once they do (or are reported dead)"
            )
        return None

    def _unanswered(self, waiting: set[int], what: str, bound_s: float) -> str:
        """The error of a query some replicas left unanswered past its bound."""
        which = "the scheduler" if len(self.replicas) == 1 else f"the scheduler of replica(s) {sorted(waiting)}"
        return f"{which} did not answer {what} within {bound_s:g} s"

    def _undo_load(self, index: int, name: str) -> None:
        """Unload ``name`` from replica ``index``, which took a load the client was told failed."""
        self.replicas.replicas[index].link.send(UnloadLora(uuid.uuid4().hex, name))

    def _on_late_lora(self, replica: int, msg: LoraUpdated) -> None:
        """An answer nobody waits for: an undo's, or a timed-out update's (a load that
        succeeded late is undone there, as the client was told it failed)."""
        owed = self.lora_owed.get(msg.query_id)
        if owed is None or replica not in owed[1]:
            return
        cmd, waiting = owed
        waiting.discard(replica)
        if not waiting:
            del self.lora_owed[msg.query_id]
        if cmd.path is not None and msg.ok:
            log.warning("replica %d loaded LoRA adapter %r after the load timed out: unloading it", replica, cmd.name)
            self._undo_load(replica, cmd.name)

    async def _reply_lora(self, query_id: str, timed_out: bool = False) -> None:
        """Answer a ``load_lora`` / ``unload_lora`` once every replica asked answered (or died),
        or at its timeout. Success when every replica succeeded, or some did and the rest already
        were as asked (a load finding it loaded, an unload finding it gone: a retry after a
        partial update converges). Otherwise the first refusal, or on a timeout a ``timeout``
        error naming the replicas that did not answer (they are owed: :meth:`_on_late_lora`).
        A load answered with an error is undone on the replicas that took it, so they stay
        alike; an unload cannot be undone (the retry converges)."""
        waiter = self.lora_waiters.pop(query_id, None)
        if waiter is None:
            return  # answered already (the timer of an answered update, or the reverse)
        waiter.timeout.cancel()
        cmd, gather = waiter.cmd, waiter.gather
        loading = cmd.path is not None
        answers = [gather.answers[index] for index in sorted(gather.answers)]
        settled = LORA_ALREADY_LOADED if loading else LORA_NOT_FOUND
        refusals = [a for a in answers if not a.ok and a.code != settled]
        took = [index for index, a in gather.answers.items() if a.ok]
        if timed_out and gather.waiting:
            self.lora_owed[query_id] = (cmd, set(gather.waiting))
            what = f"the {'load' if loading else 'unload'} of LoRA adapter {cmd.name!r}"
            undone = f"; undone on replica(s) {sorted(took)}, which had loaded it" if loading and took else ""
            reply = replies.error_map(
                cmd.request_id, self._unanswered(gather.waiting, what, LORA_UPDATE_TIMEOUT_S) + undone, wire.TIMEOUT
            )
        elif not answers:
            reply = replies.error_map(cmd.request_id, "no scheduler is alive to answer", wire.SERVER_ERROR)
        elif took and not refusals:
            reply = replies.lora_reply(cmd.request_id, cmd.name, loaded=loading)
        else:
            first = (refusals or answers)[0]
            reply = replies.error_map(cmd.request_id, first.error or first.code, first.code)
        if loading and reply["type"] == wire.ERROR:
            for index in took:
                self._undo_load(index, cmd.name)
        await self.sender.send(waiter.identity, reply)

    async def profile(self, identity: bytes, cmd: client_requests.ProfileCommand) -> None:
        """Relay to every live replica's scheduler, which answers with its and its worker's snapshots."""
        query_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        timeout = loop.call_later(
            PROFILE_TIMEOUT_S, lambda: asyncio.ensure_future(self._reply_profile(query_id, timed_out=True))
        )
        waiting = self.replicas.broadcast(ProfileQuery(query_id, cmd.window_s, cmd.trace, list(cmd.series)))
        self.profile_waiters[query_id] = (identity, cmd, timeout, Gather(waiting))

    async def _reply_profile(self, query_id: str, timed_out: bool = False, error: str | None = None) -> None:
        """This process's snapshot, then each replica's processes that answered; on a timeout,
        an error naming the schedulers that did not (or ``error``: why nobody else answers)."""
        waiter = self.profile_waiters.pop(query_id, None)
        if waiter is None:
            return  # answered already (a late report after the timeout, or the reverse)
        identity, cmd, timeout, gather = waiter
        timeout.cancel()
        if timed_out and gather.waiting:
            error = self._unanswered(gather.waiting, "the profile query", PROFILE_TIMEOUT_S)
        own = self.profiler.snapshot(cmd.window_s, trace=cmd.trace, series=cmd.series)
        processes = [profiling.profile_to_map(own), *replica_profiles(gather.answers)]
        await self.sender.send(identity, replies.profile_reply(profiling.CLOCK_NAME, cmd.window_s, processes, error))
