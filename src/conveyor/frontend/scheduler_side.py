"""The frontend's scheduler side: what the replicas' schedulers and bin/serve's control line send.

Scheduler outputs are drained per replica (at most :data:`SCHEDULER_DRAIN_LIMIT` messages a
wake-up), consecutive TokenOutputs handled as one pass of the output path
(:class:`~conveyor.frontend.output.OutputPath`); ``stats`` and ``profile`` queries relayed
to every live replica are answered once each answered or died (``profile`` also on
:data:`PROFILE_TIMEOUT_S`), and so are ``load_lora`` / ``unload_lora`` (also on
:data:`LORA_UPDATE_TIMEOUT_S`; :meth:`SchedulerSide._reply_lora` says how the replicas' answers
make one); a replica reported dead fails its requests alone; a ``Shutdown`` fails them all and
answers every query still waiting. Aborts go to the replicas that hold the requests.

LoRA updates, invariants: one update of a name at a time (a second, while one waits for its
answers or a timed-out one still owes some, is refused with ``lora_update_pending``), so a late
answer never meets a newer update of its name; a load answered with an error is undone on every
replica that took it, then or when its late success arrives (:attr:`SchedulerSide._lora_owed`),
so the replicas converge on "not loaded" and a retry starts from there.

:class:`SchedulerSide` is the part of :class:`~conveyor.frontend.server.Frontend` that does
this (a base class of it: it reads the frontend's tables, replicas, output path, sender,
profiler and counters, which :class:`~conveyor.frontend.server.Frontend` sets up).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from conveyor import profiling
from conveyor.frontend.replicas import Gather, merge_stats, replica_profiles, replica_stats
from conveyor.frontend.liveness import WATCH_INTERVAL_S
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import (
    LORA_ALREADY_LOADED,
    AbortRequests,
    LORA_NOT_FOUND,
    FinishReason,
    LoadLora,
    LoraUpdated,
    ProcessFailed,
    ProfileQuery,
    ProfileReport,
    SchedulerStats,
    Shutdown,
    TokenOutputs,
    UnloadLora,
)
from conveyor.protocol import replies, wire
from conveyor.protocol import requests as client_requests
from conveyor.runtime.config import replica_of_process
from conveyor.runtime.process import HANG_EXIT_CODE

log = logging.getLogger("conveyor.frontend")

PROFILE_TIMEOUT_S = 10.0
# How long a load_lora / unload_lora waits for every replica before the client gets a
# ``timeout`` error naming the silent ones. A load reads the adapter's files off the step loop
# (a GB of safetensors from a slow network disk takes tens of seconds), so the bound is
# generous; it stays under the clients' own wait (client.connection.DEFAULT_TIMEOUT_S, 300 s)
# so they hear why instead of timing out blind.
LORA_UPDATE_TIMEOUT_S = 120.0
# Scheduler messages handled per wake-up (queued TokenOutputs among them merged into one
# pass) before clients get their turn again: bounds how long a frontend that fell behind
# holds the loop.
SCHEDULER_DRAIN_LIMIT = 16


@dataclass
class LoraWaiter:
    """A relayed ``load_lora`` / ``unload_lora``: who asked, the replicas' answers, its timer."""

    identity: bytes
    cmd: client_requests.LoraCommand
    gather: Gather[LoraUpdated]
    timeout: asyncio.TimerHandle


class SchedulerSide:
    """The scheduler side of the frontend (module docstring).

    ``_lora_owed``: query id -> (a timed-out update, the replicas that have not answered it
    yet); an entry goes when each has answered or died."""

    async def _drain_scheduler(self, replica: int, sock: zmq.asyncio.Socket) -> None:
        """Handle what replica ``replica``'s scheduler has queued on ``sock`` (at most
        :data:`SCHEDULER_DRAIN_LIMIT` messages per wake-up, so clients are served in between),
        in order. Consecutive TokenOutputs are handled as one: a frontend that fell behind sends
        each stream one delta for all its new tokens instead of one per step, so its cost per
        step drops and it catches up."""
        if self.watch.heard(replica):
            self._scheduler_answers(replica)
        batch: list[TokenOutputs] = []
        for _ in range(SCHEDULER_DRAIN_LIMIT):
            try:
                frame = await sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = codec.decode(frame.buffer)
            except codec.DecodeError as exc:
                log.error("dropping malformed message from scheduler: %s", exc)
                continue
            self._c_sched.add()
            if isinstance(msg, TokenOutputs):
                self.replicas.on_outputs(msg)
                batch.append(msg)
                continue
            if batch:
                self._on_token_outputs(batch)
                batch = []
            await self._on_scheduler_message(replica, msg)
            if not self._running:
                return
        if batch:
            self._on_token_outputs(batch)

    def _on_token_outputs(self, batch: list[TokenOutputs]) -> None:
        """Steps' outputs, oldest first, through the output path (one pass for all of them)."""
        start = profiling.now_ns()
        num_tokens, num_outputs = self.output.on_token_outputs(batch)
        self._c_tokens.add(num_tokens)
        self._t_outputs.record(start, arg=num_outputs)
        if len(batch) > 1:
            self._s_merged.add(len(batch))

    async def _on_scheduler_message(self, replica: int, msg) -> None:
        """A message of replica ``replica``'s scheduler other than TokenOutputs."""
        if isinstance(msg, ProfileReport):
            waiter = self._profile_waiters.get(msg.query_id)
            if waiter is not None and waiter[3].add(replica, msg.profiles):
                await self._reply_profile(msg.query_id)
        elif isinstance(msg, SchedulerStats):
            waiter = self._stats_waiters.get(msg.query_id)
            if waiter is not None and waiter[2].add(replica, msg):
                await self._reply_stats(msg.query_id)
        elif isinstance(msg, LoraUpdated):
            lora = self._lora_waiters.get(msg.query_id)
            if lora is None:
                self._on_late_lora(replica, msg)
            elif lora.gather.add(replica, msg):
                await self._reply_lora(msg.query_id)

    async def _reply_stats(self, query_id: str) -> None:
        """The ``stats`` reply once every replica asked answered (or died): their stats merged
        (:func:`merge_stats`), each replica's own under ``replicas``."""
        identity, iterations, gather = self._stats_waiters.pop(query_id)
        if not gather.answers:
            error = replies.error_map(None, "no scheduler is alive to answer stats", wire.SERVER_ERROR, command=wire.STATS)
            await self.sender.send(identity, error)
            return
        reply = replies.stats_reply(merge_stats(gather.answers), len(self.in_flight), iterations=iterations)
        reply["replicas"] = replica_stats(self.replicas, gather.answers)
        await self.sender.send(identity, reply)

    async def _on_lora(self, identity: bytes, cmd: client_requests.LoraCommand) -> None:
        """Relay a ``load_lora`` / ``unload_lora`` to every live replica's scheduler; refused
        here when the server runs without --enable-lora-loading, and an unload while a request
        in flight here names the adapter (whichever replica runs it, or none yet: still
        tokenizing), so the replicas never part on it."""
        if not self.config.enable_lora_loading:
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
        timeout = loop.call_later(LORA_UPDATE_TIMEOUT_S, lambda: asyncio.ensure_future(self._reply_lora(query_id, timed_out=True)))
        self._lora_waiters[query_id] = LoraWaiter(identity, cmd, Gather(self.replicas.broadcast(msg)), timeout)

    def _lora_pending(self, name: str) -> str | None:
        """Why an update of adapter ``name`` must wait (another is unanswered), or None."""
        if any(waiter.cmd.name == name for waiter in self._lora_waiters.values()):
            return f"another load or unload of LoRA adapter {name!r} is in progress: retry once it is answered"
        owing = sorted({index for cmd, waiting in self._lora_owed.values() if cmd.name == name for index in waiting})
        if owing:
            return (f"an earlier load or unload of LoRA adapter {name!r} timed out and replica(s) {owing} have "
                    "not answered it yet: retry once they do (or are reported dead)")
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
        owed = self._lora_owed.get(msg.query_id)
        if owed is None or replica not in owed[1]:
            return
        cmd, waiting = owed
        waiting.discard(replica)
        if not waiting:
            del self._lora_owed[msg.query_id]
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
        waiter = self._lora_waiters.pop(query_id, None)
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
            self._lora_owed[query_id] = (cmd, set(gather.waiting))
            what = f"the {'load' if loading else 'unload'} of LoRA adapter {cmd.name!r}"
            undone = f"; undone on replica(s) {sorted(took)}, which had loaded it" if loading and took else ""
            reply = replies.error_map(cmd.request_id, self._unanswered(gather.waiting, what, LORA_UPDATE_TIMEOUT_S) + undone,
                                      wire.TIMEOUT)
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

    async def _on_profile(self, identity: bytes, cmd: client_requests.ProfileCommand) -> None:
        """Relay to every live replica's scheduler, which answers with its and its worker's snapshots."""
        query_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        timeout = loop.call_later(PROFILE_TIMEOUT_S, lambda: asyncio.ensure_future(self._reply_profile(query_id, timed_out=True)))
        waiting = self.replicas.broadcast(ProfileQuery(query_id, cmd.window_s, cmd.trace, list(cmd.series)))
        self._profile_waiters[query_id] = (identity, cmd, timeout, Gather(waiting))

    async def _reply_profile(self, query_id: str, timed_out: bool = False, error: str | None = None) -> None:
        """This process's snapshot, then each replica's processes that answered; on a timeout,
        an error naming the schedulers that did not (or ``error``: why nobody else answers)."""
        waiter = self._profile_waiters.pop(query_id, None)
        if waiter is None:
            return  # answered already (a late report after the timeout, or the reverse)
        identity, cmd, timeout, gather = waiter
        timeout.cancel()
        if timed_out and gather.waiting:
            error = self._unanswered(gather.waiting, "the profile query", PROFILE_TIMEOUT_S)
        own = self.profiler.snapshot(cmd.window_s, trace=cmd.trace, series=cmd.series)
        processes = [profiling.profile_to_map(own), *replica_profiles(gather.answers)]
        await self.sender.send(identity, replies.profile_reply(profiling.CLOCK_NAME, cmd.window_s, processes, error))

    async def _on_replica_failed(self, replica: int, reason: str) -> None:
        """Replica ``replica``'s scheduler or worker died (bin/serve says so, and keeps serving on
        the others): its requests get an error, nothing goes there again, and queries stop
        waiting for it. Requests on the other replicas are untouched."""
        error = f"replica {replica} failed: {reason}"
        held = self.replicas.fail(replica, error)
        log.error("%s; failing its %d request(s), serving on %d replica(s)", error, len(held), len(self.replicas.live()))
        for scheduler_id in held:
            state = self.requests.get(scheduler_id)
            if state is not None:
                self._untrack(state)
                self.output.finish(state, FinishReason.ERROR, error=error)
        for query_id, waiter in list(self._stats_waiters.items()):
            if waiter[2].drop(replica):
                await self._reply_stats(query_id)
        for query_id, waiter in list(self._profile_waiters.items()):
            if waiter[3].drop(replica):
                await self._reply_profile(query_id)
        for query_id, lora in list(self._lora_waiters.items()):
            if lora.gather.drop(replica):
                await self._reply_lora(query_id)
        for query_id, (_, waiting) in list(self._lora_owed.items()):
            waiting.discard(replica)
            if not waiting:
                del self._lora_owed[query_id]

    async def _watch_schedulers(self) -> None:
        """Every WATCH_INTERVAL_S: a replica's scheduler silent past --hang-timeout while it owes
        requests is hung (conveyor.frontend.liveness)."""
        while self._running:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for replica, silent in self.watch.check():
                await self._on_scheduler_hung(replica, silent)

    async def _on_scheduler_hung(self, replica: int, silent: float) -> None:
        """Fail what replica ``replica`` owes; stop the server (``exit``: the frontend's own
        shutdown, then exit status HANG_EXIT_CODE, which bin/serve reports) or route nothing
        there until it answers (``wait``; it is told to abort what was failed)."""
        error = self.watch.error(replica, silent)
        log.error("%s", error)
        if self.watch.exit:  # through the frontend's own shutdown: its loop wakes on the control line
            self._exit_code = HANG_EXIT_CODE
            own = transport.socket(zmq.Context.shadow(self.ctx.underlying), zmq.PUSH, self.config.addresses.frontend_control, bind=False)
            own.setsockopt(zmq.LINGER, 1000)
            transport.send(own, Shutdown(error))
            own.close()
            return
        held = self.replicas.fail(replica, error)
        for scheduler_id in held:
            state = self.requests.get(scheduler_id)
            if state is not None:
                self._untrack(state)
                self.output.finish(state, FinishReason.ERROR, error=error)
        if held:
            self.replicas.replicas[replica].link.send(AbortRequests(held))  # read once it runs again

    def _scheduler_answers(self, replica: int) -> None:
        """A hung replica's scheduler answered again: route to it again (``wait``)."""
        state = self.replicas.replicas[replica]
        if not state.alive and state.death is not None and state.death.startswith("scheduler hung"):
            state.alive, state.death = True, None
            log.warning("replica %d's scheduler answers again: routing requests to it", replica)

    async def fail_all(self, reason: str) -> None:
        """Give every in-flight request an error, and every query still waiting for the
        replicas (``stats``, ``profile``, ``load_lora`` / ``unload_lora``) its answer with
        ``reason`` as the error (a peer process died or we are shutting down): nobody is left
        waiting for a reply that will not come."""
        states = list(self.in_flight.values())
        self.in_flight.clear()
        self.requests.clear()
        for state in states:
            self.output.finish(state, FinishReason.ERROR, error=reason)
        for query_id in list(self._stats_waiters):
            identity = self._stats_waiters.pop(query_id)[0]
            await self.sender.send(identity, replies.error_map(None, reason, wire.SERVER_ERROR, command=wire.STATS))
        for query_id in list(self._profile_waiters):
            await self._reply_profile(query_id, error=reason)
        for query_id in list(self._lora_waiters):
            waiter = self._lora_waiters.pop(query_id)
            waiter.timeout.cancel()
            await self.sender.send(waiter.identity, replies.error_map(waiter.cmd.request_id, reason, wire.SERVER_ERROR))
        self._lora_owed.clear()

    async def _on_control(self, frame) -> None:
        try:
            msg = codec.decode(frame.buffer)
        except codec.DecodeError as exc:
            log.error("dropping malformed control message: %s", exc)
            return
        if isinstance(msg, Shutdown):
            # A start-up failure is bin/serve's one line to print; the echo would be a second.
            (log.debug if msg.reason.startswith("startup failed") else log.info)("shutting down: %s", msg.reason)
            await self.fail_all(msg.reason)
            self._running = False
        elif isinstance(msg, ProcessFailed):  # bin/serve: a replica died, the others serve on
            replica = replica_of_process(msg.process)
            if replica is not None and replica < len(self.replicas) and self.replicas.replicas[replica].alive:
                await self._on_replica_failed(replica, msg.reason)

    def _abort_at_scheduler(self, request_ids: list[str]) -> None:
        """Abort requests at the replicas that hold them (:meth:`ReplicaSet.abort`)."""
        self.replicas.abort(request_ids)
