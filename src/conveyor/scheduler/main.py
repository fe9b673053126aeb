"""The scheduler process: one synchronous loop around :class:`Scheduler`.

Each iteration: take everything the frontend sent (new requests, aborts, stats
queries) without blocking, form a plan and send it to the worker, wait for the result
of the oldest plan in flight, apply it, and send the iteration's outputs to the frontend
in one message. With nothing to run it blocks on the frontend socket instead of spinning.

**Overlap** (on by default, ``--no-overlap`` turns it off for comparison): with a plan in
flight the loop forms and sends the next one *before* waiting for the result, so the
worker finds plan N+1 queued when it finishes step N and never waits for this process;
applying N's result, flushing outputs and planning N+2 all happen while the worker runs
N+1. The scheduler plans ahead conservatively (see :mod:`conveyor.scheduler.scheduler`):
when it cannot, the next plan is formed after the result, as without overlap.

Plans and results travel on the step channel (:mod:`conveyor.ipc.step_channel`): a
shared-memory ring each way by default, ZeroMQ with ``--plan-transport zmq``. With tensor
parallelism the plan channel has a reader per worker rank; this loop still sends each plan
once and hears from rank 0 alone, so it knows nothing of the ranks beyond the KV pool it was
sized with (the smallest any rank can hold). A result is
decoded in place; its slots and sampled tokens are copied out before the next result is
asked for. Plans and results name requests by slot (see :mod:`conveyor.scheduler.scheduler`).

The worker is never waited on blindly: the wait polls in slices, serving the frontend
meanwhile, and gives up when bin/serve says to stop (Shutdown) or the worker's process is
gone (the ring's writer pid; on ZeroMQ, bin/serve notices a dead worker and stops us).

Profiling: each iteration's schedule, update and output flush are timed, and so is the plan
round trip (send to result); for a plan sent while none was in flight, the round trip minus
the worker's own execute time is the transport cost (a plan sent ahead also waits for the
step before it, so it says nothing about transport). Batch shape per step (sequences, tokens,
waiting) is kept as series, the occupancy timeline bin/bench plots. A ProfileQuery is forwarded to
the worker on the plan socket, so the worker answers between steps and never mid-step; its report
comes back on the result socket (while a plan is in flight, or in the idle wait, which polls both
sockets) and goes to the frontend with this process's snapshot in front.

LoRA adapters loaded while serving (:mod:`conveyor.ipc.messages.lora_updates`): a LoadLora
goes to the worker on the plan channel like a profile query (one at a time, the name
reserved meanwhile so a second load of it is refused); when the worker says its read is over
(LoraRead) a CommitLora follows it, and requests may name the adapter once the worker's
LoraUpdated says it loaded. An UnloadLora is decided here: refused while a
live request names the adapter (``lora_in_use``), else the name is forgotten at once (a
request naming it from now on is refused) and the worker is told to free it after the plans
already sent, none of which a later plan could still need.

Weight updates, sleep and wake, pause and continue (:mod:`conveyor.scheduler.control_gate`):
applied between steps, with nothing in flight; a paused loop plans nothing.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import numpy as np
import zmq

from conveyor import profiling
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import (
    LORA_ALREADY_LOADED,
    LORA_IN_USE,
    LORA_NOT_FOUND,
    AbortRequests,
    AddRequest,
    CommitLora,
    ContinueGeneration,
    EngineControlled,
    EngineStateQuery,
    FinishReason,
    LoadLora,
    LoraRead,
    LoraUpdated,
    PauseGeneration,
    ProfileQuery,
    ProfileReport,
    RequestOutput,
    SchedulerStats,
    Shutdown,
    SleepEngine,
    StatsQuery,
    StepPlan,
    StepResult,
    TokenOutputs,
    UnloadLora,
    UpdateWeights,
    WakeEngine,
)
from conveyor.ipc.step_channel import PeerGone, StepSender
from conveyor.ipc.step_receivers import StepReceiver
from conveyor.runtime.config import SchedulerProcessConfig
from conveyor.runtime.process import HANG_EXIT_CODE, Started, run_process
from conveyor.scheduler.control_gate import ControlGate
from conveyor.scheduler.liveness import HangWatch
from conveyor.scheduler.scheduler import Scheduler

log = logging.getLogger("conveyor.scheduler")

IDLE_POLL_MS = 100
CONTROL_MESSAGES = (UpdateWeights, SleepEngine, WakeEngine, PauseGeneration, ContinueGeneration, EngineStateQuery)


class SchedulerLoop:
    def __init__(self, config: SchedulerProcessConfig, ctx: zmq.Context) -> None:
        self.scheduler = Scheduler(config.scheduler, config.eos_token_ids, config.vocab_size)
        addrs = config.addresses
        self.from_frontend = transport.socket(ctx, zmq.PULL, addrs.to_scheduler, bind=True)
        self.to_frontend = transport.socket(ctx, zmq.PUSH, addrs.to_frontend, bind=False)
        self.to_worker = StepSender(ctx, config.channels.plans, bind=True)
        self.from_worker = StepReceiver(ctx, config.channels.results, bind=True)
        self.running = True
        self.overlap = config.overlap
        self._pending: list[RequestOutput] = []
        # Plain next tokens of the iteration, as TokenOutputs columns (see TokenOutputs).
        self._column_ids: list[str] = []
        self._column_tokens: list[int] = []
        self._poller = zmq.Poller()
        self._poller.register(self.from_frontend, zmq.POLLIN)
        self._poller.register(self.from_worker.pollable(), zmq.POLLIN)
        # Profile queries relayed to the worker one at a time: with at most two plans and one
        # query in flight, neither ring can fill while both ends wait on each other.
        self._profile_queries: deque[ProfileQuery] = deque()
        self._lora_loads: deque[LoadLora] = deque()  # likewise, each reserving its name
        self.watch = HangWatch(config.hang_timeout, config.on_hang)
        self.gate = ControlGate(self.scheduler, config.asleep_requests)
        self._init_profiling(config.profile)

    def _init_profiling(self, enabled: bool) -> None:
        prof = self.profiler = profiling.Profiler("scheduler", enabled=enabled)
        self._t_intake = prof.timer("intake", arg_name="messages")
        self._t_schedule = prof.timer("schedule", arg_name="step")
        self._t_round_trip = prof.timer("plan_round_trip", arg_name="step")
        self._t_update = prof.timer("update", arg_name="step")
        self._t_flush = prof.timer("send_outputs", arg_name="outputs")
        self._s_transport = prof.series("transport_overhead", "ms")
        steps = 1 << 16  # per-step series feed timelines: keep more of them
        self._s_seqs = prof.series("batch_seqs", "seqs", capacity=steps)
        self._s_tokens = prof.series("batch_tokens", "tokens", capacity=steps)
        self._s_waiting = prof.series("num_waiting", "requests", capacity=steps)
        self._c_frontend = prof.counter("frontend_messages")
        self._c_steps = prof.counter("steps")

    def _record_plan(self, plan: StepPlan) -> None:
        cached = plan.cached_requests
        self._s_seqs.add(len(plan.new_requests) + len(cached))
        self._s_tokens.add(sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(cached.num_scheduled_tokens))
        self._s_waiting.add(self.scheduler.num_waiting)
        self._c_steps.add()

    def run(self) -> None:
        wait_ms = 0
        sched = self.scheduler
        inflight = sched.state.inflight  # plans sent and not yet applied, oldest first
        while self.running:
            paused = self.gate.paused
            block = not inflight and (paused or not sched.has_work()) and not self._pending
            self._take_frontend_messages(timeout_ms=IDLE_POLL_MS if block else wait_ms)
            if not self.running:
                break
            wait_ms = 0
            if not inflight and not sched.has_work():
                self._next_control()
            paused = self.gate.paused
            if not inflight and not paused:
                self._schedule_and_send()
            if inflight and self.overlap and sched.can_plan_ahead:
                self._schedule_and_send()  # plan N+1 while the worker runs N
            if inflight:
                oldest = inflight.oldest
                plan = oldest.plan
                # (its round trip is clean when it was sent with nothing else in flight)
                result = self._await_result(plan, oldest.sent_ns, not plan.planned_ahead)
                if result is None:
                    break
                start = profiling.now_ns()
                outputs = sched.update(plan, result)
                self._pending.extend(outputs.outputs)
                self._column_ids.extend(outputs.request_ids)
                self._column_tokens.extend(outputs.token_ids)
                self._t_update.record(start, arg=plan.step_id)
            elif sched.has_work() and not paused:
                # Live requests but nothing to run yet (the admission gate waits for company,
                # min_batch_size / max_wait_ms): sleep on the sockets until then, not spin.
                ready_in = sched.seconds_until_ready()
                wait_ms = IDLE_POLL_MS if ready_in is None else max(1, min(IDLE_POLL_MS, math.ceil(ready_in * 1000)))
            self._flush_outputs()

    def _schedule_and_send(self) -> None:
        start = profiling.now_ns()
        plan = self.scheduler.schedule()
        self._pending.extend(self.scheduler.take_outputs())  # queue timeouts
        if plan is None:
            return
        self._t_schedule.record(start, arg=plan.step_id)
        self._record_plan(plan)
        inflight = self.scheduler.state.inflight
        if len(inflight) == 1:  # nothing was in flight: the worker's time on it starts now
            self.watch.started()
        inflight.newest.sent_ns = profiling.now_ns()
        self.to_worker.send(plan)

    def _take_frontend_messages(self, timeout_ms: int) -> None:
        if timeout_ms:
            # Idle: no plan is in flight, so the worker speaks only to answer a profile query.
            frontend_ready, worker_ready = self._poll(timeout_ms)
            if worker_ready:
                self._take_worker_reports()
            if not frontend_ready:
                return
        start, count = profiling.now_ns(), 0
        while self.running:
            try:
                frame = self.from_frontend.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            count += 1
            try:
                msg = codec.decode(frame.buffer)
            except codec.DecodeError as exc:
                log.error("dropping malformed message from frontend: %s", exc)
                continue
            self._handle(msg)
        if count:
            self._t_intake.record(start, arg=count)
            self._c_frontend.add(count)

    def _poll(self, timeout_ms: int) -> tuple[bool, bool]:
        """Sleep until the frontend or the worker has a message, or ``timeout_ms`` passes;
        returns (frontend ready, worker ready). Raises PeerGone if the worker's process is gone."""
        worker = self.from_worker
        if worker.spin() or worker.arm():
            worker.disarm()
            return bool(self.from_frontend.poll(0)), True
        events = dict(self._poller.poll(timeout_ms))
        worker.disarm()
        worker_ready = worker.ready()
        if not events and not worker_ready and not worker.peer_alive():
            raise PeerGone("the worker process is gone")
        return self.from_frontend in events, worker_ready

    def _take_worker_reports(self) -> None:
        """Drain the worker's channel while no plan is in flight: only profile reports belong there."""
        while True:
            try:
                msg = self.from_worker.recv(0)
            except codec.DecodeError as exc:
                log.error("malformed message from worker: %s", exc)
                continue
            if msg is None:
                return
            if isinstance(msg, (ProfileReport, LoraRead, LoraUpdated, EngineControlled)):
                self._on_worker_report(msg)
            else:
                log.error("unexpected worker message %s with no plan in flight", type(msg).__name__)

    def _on_worker_report(self, report: ProfileReport | LoraRead | LoraUpdated | EngineControlled) -> None:
        if isinstance(report, ProfileReport):
            self._on_worker_profile(report)
            return
        if isinstance(report, EngineControlled):
            answer = self.gate.worker_answered(report)
            if answer is None:
                log.error("engine control report %r answers no outstanding command", report.query_id)
                return
            log.info("engine control %s: %s", report.query_id, answer.error or "done")
            transport.send(self.to_frontend, answer)
            for held in self.gate.release():
                self._handle(held)
            return
        loads = self._lora_loads
        if not loads or loads[0].query_id != report.query_id:
            log.error("LoRA report %r answers no outstanding load", report.query_id)
            return
        if isinstance(report, LoraRead):  # every rank registers it between the same two plans
            self.to_worker.send(CommitLora(report.query_id))
            return
        loads.popleft()
        if report.ok:
            self.scheduler.add_lora(report.name)
            log.info("loaded LoRA adapter %r", report.name)
        transport.send(self.to_frontend, report)
        if loads:
            self.to_worker.send(loads[0])

    def _on_load_lora(self, msg: LoadLora) -> None:
        if msg.name in self.scheduler.lora_names or any(load.name == msg.name for load in self._lora_loads):
            error = (
                f"LoRA adapter {msg.name!r} is already loaded (unload it first to load other weights under its name)"
            )
            transport.send(self.to_frontend, LoraUpdated(msg.query_id, msg.name, LORA_ALREADY_LOADED, error))
            return
        self._lora_loads.append(msg)
        if len(self._lora_loads) == 1:
            self.to_worker.send(msg)

    def _on_unload_lora(self, msg: UnloadLora) -> None:
        answer = LoraUpdated(msg.query_id, msg.name)
        if msg.name not in self.scheduler.lora_names:
            answer.code, answer.error = LORA_NOT_FOUND, f"no LoRA adapter {msg.name!r} is loaded"
        else:
            try:
                self.scheduler.remove_lora(msg.name)
            except ValueError as exc:  # live requests name it
                answer.code, answer.error = LORA_IN_USE, f"{exc}: unload it once they finish (or abort them)"
            else:
                self.to_worker.send(msg)
                log.info("unloaded LoRA adapter %r", msg.name)
        transport.send(self.to_frontend, answer)

    def _on_worker_profile(self, report: ProfileReport) -> None:
        queries = self._profile_queries
        if not queries or queries[0].query_id != report.query_id:
            log.error("profile report %r answers no outstanding query", report.query_id)
            return
        query = queries.popleft()
        own = self.profiler.snapshot(query.window_s, trace=query.trace, series=query.series)
        transport.send(self.to_frontend, ProfileReport(query.query_id, [own, *report.profiles]))
        if queries:
            self.to_worker.send(queries[0])

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            refusal = self.watch.refusal()
            if refusal is not None:
                self._pending.append(RequestOutput(msg.request_id, [], FinishReason.ERROR, error=refusal))
                return
            rejected = self.gate.admit(msg)
            if rejected is not None:
                self._pending.append(rejected)
        elif isinstance(msg, CONTROL_MESSAGES):
            answer, aborted = self.gate.receive(msg)
            self._pending.extend(aborted)
            if answer is not None:
                self._flush_outputs()  # (the aborts before the answer)
                transport.send(self.to_frontend, answer)
        elif isinstance(msg, AbortRequests):
            self.gate.forget(msg.request_ids)
            self._pending.extend(self.scheduler.abort(msg.request_ids))
        elif isinstance(msg, StatsQuery):
            transport.send(
                self.to_frontend,
                SchedulerStats(query_id=msg.query_id, **{**self.scheduler.stats(), "num_hung": int(self.watch.hung)}),
            )
        elif isinstance(msg, ProfileQuery):
            # On the plan channel, behind any plan in flight: the worker answers between steps.
            self._profile_queries.append(msg)
            if len(self._profile_queries) == 1:
                self.to_worker.send(msg)
        elif isinstance(msg, LoadLora):
            self._on_load_lora(msg)
        elif isinstance(msg, UnloadLora):
            self._on_unload_lora(msg)
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.error("unexpected message %s from frontend", type(msg).__name__)

    def _next_control(self) -> None:
        """With nothing in flight: send the next weight update, sleep or wake to the worker
        ranks (on the plan channel, between two steps), or answer a ``wait`` pause."""
        while True:
            command, answer = self.gate.next_command(idle=True)
            if command is not None:
                self.to_worker.send(command)
                return
            if answer is None:
                return
            transport.send(self.to_frontend, answer)

    def _await_result(self, plan: StepPlan, sent: int, clean: bool) -> StepResult | None:
        """Wait for the result of ``plan`` (the oldest in flight), still serving the frontend
        meanwhile; None when told to stop."""
        while True:
            frontend_ready, worker_ready = self._poll(IDLE_POLL_MS)
            if worker_ready:
                try:
                    result = self.from_worker.recv(0)
                except codec.DecodeError as exc:
                    log.error("malformed result from worker: %s", exc)
                    return StepResult(plan.step_id, [], [], error=f"malformed worker result: {exc}")
                if isinstance(result, (ProfileReport, LoraRead, LoraUpdated, EngineControlled)):
                    self._on_worker_report(result)
                    continue
                if not isinstance(result, StepResult) or result.step_id != plan.step_id:
                    log.error("unexpected worker message %r", result)
                    continue
                hung_for = self.watch.stepped()
                if hung_for is not None:
                    log.warning(
                        "the worker is stepping again after %.1f s without a result: serving requests again", hung_for
                    )
                end = self._t_round_trip.record(sent, arg=plan.step_id)
                if clean:
                    self._s_transport.add(max(0.0, (end - sent) / 1e6 - result.forward_time * 1e3))
                # Out of the ring slot (released at the next receive): update() reads the
                # columns with numpy, so a copy of each array is all it takes.
                result.slots = np.array(result.slots)
                result.sampled_token_ids = np.array(result.sampled_token_ids)
                return result
            if frontend_ready:
                # Aborts and new requests queue up in the scheduler; aborts of requests in
                # this step are reconciled by update().
                self._take_frontend_messages(timeout_ms=0)
                if not self.running:
                    return None
                if self.watch.hung:  # refusals go out now, not after a step that may never end
                    self._flush_outputs()
            elif not worker_ready:
                self._check_hang()

    def _check_hang(self) -> None:
        """A worker silent past --hang-timeout with a plan in flight: fail every live request
        with the error (its plan's ones as aborted: update() drops what the worker may still
        send for them), then stop (--on-hang exit) or refuse new requests until it steps
        (--on-hang wait); conveyor.scheduler.liveness."""
        error = self.watch.check()
        if error is None:
            return
        log.error("%s", error)
        sched = self.scheduler
        self._pending.extend(sched.abort(list(sched.state.table.live), error=error))
        self._flush_outputs()
        if self.watch.exit:
            raise SystemExit(HANG_EXIT_CODE)

    def _flush_outputs(self) -> None:
        if self._pending or self._column_ids:
            for out in self._pending:  # (what finishes ran on this version: an update waits for it)
                if out.finish_reason is not None:
                    out.weight_version = self.gate.weight_version
            start = profiling.now_ns()
            transport.send(self.to_frontend, TokenOutputs(self._pending, self._column_ids, self._column_tokens))
            self._t_flush.record(start, arg=len(self._pending) + len(self._column_ids))
            self._pending = []
            self._column_ids = []
            self._column_tokens = []

    def close(self) -> None:
        for sock in (self.from_frontend, self.to_frontend):
            sock.close(linger=0)
        self.to_worker.close()
        self.from_worker.close()


def run_scheduler(config: SchedulerProcessConfig) -> None:
    def start(ctx: zmq.Context) -> Started:
        loop = SchedulerLoop(config, ctx)
        return Started(run=loop.run, close=loop.close, ready_info={"num_blocks": config.scheduler.num_blocks})

    run_process("scheduler", config.addresses.control, start)
