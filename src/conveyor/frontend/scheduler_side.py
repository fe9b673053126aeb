"""The frontend's scheduler side: what the replicas' schedulers and bin/serve's control line send.

Scheduler outputs are drained per replica (at most :data:`SCHEDULER_DRAIN_LIMIT` messages a
wake-up), consecutive TokenOutputs handled as one pass of the output path; answers to relayed
queries go to the relays (:mod:`conveyor.frontend.relays`); a replica reported dead or hung
fails its requests alone; a ``Shutdown`` fails them all. Aborts go to the replicas that hold
the requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from conveyor import profiling
from conveyor.frontend.liveness import WATCH_INTERVAL_S, SchedulerWatch
from conveyor.frontend.output import OutputPath
from conveyor.frontend.relays import Relays
from conveyor.frontend.replicas import ReplicaSet
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.shares import ClientShares
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import AbortRequests, FinishReason, ProcessFailed, Shutdown, TokenOutputs
from conveyor.runtime.config import replica_of_process
from conveyor.runtime.process import HANG_EXIT_CODE

log = logging.getLogger("conveyor.frontend")

# Scheduler messages handled per wake-up (queued TokenOutputs among them merged into one
# pass) before clients get their turn again: bounds how long a frontend that fell behind
# holds the loop.
SCHEDULER_DRAIN_LIMIT = 16


@dataclass
class LoopState:
    """The frontend loop's fate, shared with the scheduler side: whether it runs on, and the
    exit status the process ends with (nonzero: the frontend stopped the server itself)."""

    running: bool = True
    exit_code: int = 0


class SchedulerSide:
    """The scheduler side of the frontend (module docstring): over the frontend's tables
    (``in_flight`` by key, ``requests`` by scheduler id) and parts; ``untrack`` forgets a
    request; ``ctx`` and ``control_address``: where a hung scheduler's shutdown is sent."""

    def __init__(
        self,
        loop: LoopState,
        in_flight: dict[tuple[bytes, str], RequestState],
        requests: dict[str, RequestState],
        parts: tuple[ClientShares, ReplicaSet, SchedulerWatch, OutputPath, Relays],
        profiler: profiling.Profiler,
        *,
        untrack: Callable[[RequestState], None],
        ctx: zmq.asyncio.Context,
        control_address: str,
    ) -> None:
        self.loop = loop
        self.in_flight, self.requests = in_flight, requests
        self.shares, self.replicas, self.watch, self.output, self.relays = parts
        self._untrack = untrack
        self.ctx = ctx
        self.control_address = control_address
        self._t_outputs = profiler.timer("handle_outputs", arg_name="outputs")
        self._s_merged = profiler.series("merged_steps", "steps")  # behind: steps handled as one
        self._c_sched = profiler.counter("scheduler_messages")
        self._c_tokens = profiler.counter("output_tokens")

    async def drain(self, replica: int, sock: zmq.asyncio.Socket) -> None:
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
                self.on_token_outputs(batch)
                batch = []
            await self._on_scheduler_message(replica, msg)
            if not self.loop.running:
                return
        if batch:
            self.on_token_outputs(batch)

    def on_token_outputs(self, batch: list[TokenOutputs]) -> None:
        """Steps' outputs, oldest first, through the output path (one pass for all of them)."""
        start = profiling.now_ns()
        num_tokens, num_outputs = self.output.on_token_outputs(batch)
        self._c_tokens.add(num_tokens)
        self._t_outputs.record(start, arg=num_outputs)
        if len(batch) > 1:
            self._s_merged.add(len(batch))

    async def _on_scheduler_message(self, replica: int, msg) -> None:
        """A message of replica ``replica``'s scheduler other than TokenOutputs: an answer to a relayed query."""
        await self.relays.on_answer(replica, msg)

    async def _on_replica_failed(self, replica: int, reason: str) -> None:
        """Replica ``replica``'s scheduler or worker died (bin/serve says so, and keeps serving on
        the others): its requests get an error, nothing goes there again, and queries stop
        waiting for it. Requests on the other replicas are untouched."""
        error = f"replica {replica} failed: {reason}"
        held = self.replicas.fail(replica, error)
        log.error(
            "%s; failing its %d request(s), serving on %d replica(s)", error, len(held), len(self.replicas.live())
        )
        for scheduler_id in held:
            state = self.requests.get(scheduler_id)
            if state is not None:
                self._untrack(state)
                self.output.finish(state, FinishReason.ERROR, error=error)
        await self.relays.replica_gone(replica)

    async def watch_schedulers(self) -> None:
        """Every WATCH_INTERVAL_S: a replica's scheduler silent past --hang-timeout while it owes
        requests is hung (conveyor.frontend.liveness)."""
        while self.loop.running:
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
            self.loop.exit_code = HANG_EXIT_CODE
            own = transport.socket(zmq.Context.shadow(self.ctx.underlying), zmq.PUSH, self.control_address, bind=False)
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
        self.shares.held.clear()
        self.requests.clear()
        for state in states:
            self.output.finish(state, FinishReason.ERROR, error=reason)
        await self.relays.fail_all(reason)

    async def on_control(self, frame) -> None:
        try:
            msg = codec.decode(frame.buffer)
        except codec.DecodeError as exc:
            log.error("dropping malformed control message: %s", exc)
            return
        if isinstance(msg, Shutdown):
            # A start-up failure is bin/serve's one line to print; the echo would be a second.
            (log.debug if msg.reason.startswith("startup failed") else log.info)("shutting down: %s", msg.reason)
            await self.fail_all(msg.reason)
            self.loop.running = False
        elif isinstance(msg, ProcessFailed):  # bin/serve: a replica died, the others serve on
            replica = replica_of_process(msg.process)
            if replica is not None and replica < len(self.replicas) and self.replicas.replicas[replica].alive:
                await self._on_replica_failed(replica, msg.reason)
