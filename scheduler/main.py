"""The scheduler process: one synchronous loop around :class:`Scheduler`.

Each iteration: take everything the frontend sent (new requests, aborts, stats
queries) without blocking, form a plan, send it to the worker, wait for its
result, and send the iteration's outputs to the frontend in one message. With
nothing to run it blocks on the frontend socket instead of spinning.

The worker is never waited on blindly: the wait polls in slices and gives up
when bin/serve says to stop (Shutdown) or the worker stops answering for
``worker_timeout_s`` (bin/serve notices a dead worker process and stops us).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from conveyor.common import codec, transport
from conveyor.common.config import SchedulerConfig
from conveyor.common.messages import (
    AbortRequests,
    AddRequest,
    RequestOutput,
    SchedulerStats,
    Shutdown,
    StatsQuery,
    StepPlan,
    StepResult,
    TokenOutputs,
)
from conveyor.common.process import ControlChannel, die_with_parent, setup_logging
from conveyor.common.transport import ServerAddresses
from conveyor.scheduler.scheduler import Scheduler

log = logging.getLogger("conveyor.scheduler")

IDLE_POLL_MS = 100


@dataclass(frozen=True)
class SchedulerProcessConfig:
    scheduler: SchedulerConfig
    addresses: ServerAddresses
    eos_token_ids: list[int]
    vocab_size: int


class SchedulerLoop:
    def __init__(self, config: SchedulerProcessConfig, ctx: zmq.Context) -> None:
        self.scheduler = Scheduler(config.scheduler, config.eos_token_ids, config.vocab_size)
        addrs = config.addresses
        self.from_frontend = transport.socket(ctx, zmq.PULL, addrs.to_scheduler, bind=True)
        self.to_frontend = transport.socket(ctx, zmq.PUSH, addrs.to_frontend, bind=False)
        self.to_worker = transport.socket(ctx, zmq.PUSH, addrs.plans, bind=True)
        self.from_worker = transport.socket(ctx, zmq.PULL, addrs.results, bind=True)
        self.running = True
        self._pending: list[RequestOutput] = []
        self._poller = zmq.Poller()
        self._poller.register(self.from_frontend, zmq.POLLIN)
        self._poller.register(self.from_worker, zmq.POLLIN)

    def run(self) -> None:
        while self.running:
            block = not self.scheduler.has_work() and not self._pending
            self._take_frontend_messages(timeout_ms=IDLE_POLL_MS if block else 0)
            if not self.running:
                break
            plan = self.scheduler.schedule()
            if plan is not None:
                result = self._execute(plan)
                if result is None:
                    break
                self._pending.extend(self.scheduler.update(plan, result))
            self._flush_outputs()

    def _take_frontend_messages(self, timeout_ms: int) -> None:
        if timeout_ms and not self.from_frontend.poll(timeout_ms):
            return
        while self.running:
            try:
                frame = self.from_frontend.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = codec.decode(frame.buffer)
            except codec.DecodeError as exc:
                log.error("dropping malformed message from frontend: %s", exc)
                continue
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            rejected = self.scheduler.add_request(msg)
            if rejected is not None:
                self._pending.append(rejected)
        elif isinstance(msg, AbortRequests):
            self._pending.extend(self.scheduler.abort(msg.request_ids))
        elif isinstance(msg, StatsQuery):
            s = self.scheduler.stats()
            transport.send(
                self.to_frontend,
                SchedulerStats(
                    query_id=msg.query_id,
                    total_blocks=s["total_blocks"],
                    free_blocks=s["free_blocks"],
                    held_blocks=s["held_blocks"],
                    num_running=s["num_running"],
                    num_waiting=s["num_waiting"],
                    num_steps=s["num_steps"],
                    num_preemptions=s["num_preemptions"],
                ),
            )
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.error("unexpected message %s from frontend", type(msg).__name__)

    def _execute(self, plan: StepPlan) -> StepResult | None:
        """Send a plan and wait for its result, still serving the frontend meanwhile."""
        transport.send(self.to_worker, plan)
        while True:
            events = dict(self._poller.poll(IDLE_POLL_MS))
            if self.from_worker in events:
                try:
                    result = transport.recv(self.from_worker)
                except codec.DecodeError as exc:
                    log.error("malformed result from worker: %s", exc)
                    return StepResult(plan.step_id, [], [], error=f"malformed worker result: {exc}")
                if not isinstance(result, StepResult) or result.step_id != plan.step_id:
                    log.error("unexpected worker message %r", result)
                    continue
                return result
            if self.from_frontend in events:
                # Aborts and new requests queue up in the scheduler; aborts of requests in
                # this step are reconciled by update().
                self._take_frontend_messages(timeout_ms=0)
                if not self.running:
                    return None

    def _flush_outputs(self) -> None:
        if self._pending:
            transport.send(self.to_frontend, TokenOutputs(self._pending))
            self._pending = []

    def close(self) -> None:
        for sock in (self.from_frontend, self.to_frontend, self.to_worker, self.from_worker):
            sock.close(linger=0)


def run_scheduler(config: SchedulerProcessConfig) -> None:
    die_with_parent()
    log = setup_logging("scheduler")
    ctx = zmq.Context()
    control = ControlChannel(ctx, config.addresses.control, "scheduler")
    try:
        loop = SchedulerLoop(config, ctx)
    except Exception as exc:
        log.exception("scheduler failed to start")
        control.failed(f"scheduler: {exc}")
        return
    control.ready(num_blocks=config.scheduler.num_blocks)
    try:
        loop.run()
    finally:
        loop.close()
        control.close()
        ctx.term()
