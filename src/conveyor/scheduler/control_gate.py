"""The scheduler's side of weight updates, sleep and wake, pause and continue
(:mod:`conveyor.ipc.messages.engine_control`; docs/rl.md).

An update, a sleep or a wake is queued here; once nothing is in flight (what ran finished, or
was aborted when the command came), the loop sends it to the worker ranks and holds every
request that arrives meanwhile, releasing them when the worker has answered. While asleep,
new requests wait for the wake (``asleep_requests`` ``wait``) or are refused (``refuse``).
A pause stops the loop from planning; its ``wait`` mode is queued like an update.
"""

from __future__ import annotations

from collections import deque

from conveyor.ipc.messages import (
    AddRequest,
    ContinueGeneration,
    EngineControlled,
    EngineStateQuery,
    PauseGeneration,
    RequestOutput,
    SleepEngine,
    UpdateWeights,
    WakeEngine,
)
from conveyor.ipc.messages.engine_control import (
    ABORT,
    CONTROL_INVALID,
    FINISH,
    IN_FLIGHT_MODES,
    PAUSE_MODES,
    WAIT,
)
from conveyor.scheduler.scheduler import Scheduler

ASLEEP_REQUESTS = ("wait", "refuse")
ControlMessage = UpdateWeights | SleepEngine | WakeEngine | PauseGeneration | ContinueGeneration | EngineStateQuery
WORKER_COMMANDS = (UpdateWeights, SleepEngine, WakeEngine)


class ControlGate:
    """The engine's state as the scheduler keeps it (weight version, sleep level, paused), the
    commands waiting for the requests in flight to end or for the worker, and the requests held
    meanwhile."""

    def __init__(self, scheduler: Scheduler, asleep_requests: str = "wait") -> None:
        if asleep_requests not in ASLEEP_REQUESTS:
            raise ValueError(f"asleep_requests must be one of {ASLEEP_REQUESTS}, got {asleep_requests!r}")
        self.scheduler = scheduler
        self.asleep_requests = asleep_requests
        self.weight_version = 0
        self.sleep_level = 0
        self.paused = False
        self.queue: deque[UpdateWeights | SleepEngine | WakeEngine | PauseGeneration] = deque()
        self.at_worker: UpdateWeights | SleepEngine | WakeEngine | None = None
        self.held: list[AddRequest] = []

    def answer(self, query_id: str, code: str = "ok", error: str | None = None, freed: int = 0) -> EngineControlled:
        return EngineControlled(query_id, code, error, self.weight_version, self.sleep_level, self.paused, freed)

    def admit(self, msg: AddRequest) -> RequestOutput | None:
        """Whether ``msg`` goes to the scheduler now: None if it does or is held here (see
        :attr:`held`), else its refusal."""
        waking = any(isinstance(m, WakeEngine) for m in self.queue) or isinstance(self.at_worker, WakeEngine)
        if self.sleep_level and self.asleep_requests == "refuse" and not waking:
            error = (
                f"the server is asleep (level {self.sleep_level}): wake_up first (bin/serve --asleep-requests wait "
                "holds requests until then)"
            )
            return RequestOutput(msg.request_id, [], "error", error=error)
        if self.queue or self.at_worker is not None or self.sleep_level:
            self.held.append(msg)
            return None
        return self.scheduler.add_request(msg)

    def receive(self, msg: ControlMessage) -> tuple[EngineControlled | None, list[RequestOutput]]:
        """Take a command from the frontend: its answer now (None: later, :meth:`next_command`
        or :meth:`worker_answered`) and the outputs of requests it aborted."""
        sched, qid = self.scheduler, msg.query_id
        live = bool(sched.state.table.live)
        if isinstance(msg, EngineStateQuery):
            return self.answer(qid), []
        if isinstance(msg, ContinueGeneration):
            self.paused = False
            return self.answer(qid), []
        if isinstance(msg, PauseGeneration):
            if msg.mode not in PAUSE_MODES:
                return self.answer(
                    qid, CONTROL_INVALID, f"pause mode must be one of {PAUSE_MODES}, got {msg.mode!r}"
                ), []
            aborted = self._abort("generation paused") if msg.mode == ABORT else []
            if msg.mode == WAIT:
                self.queue.append(msg)
                return None, aborted
            self.paused = True
            return self.answer(qid), aborted
        refusal = self._refusal(msg, live)
        if refusal is not None:
            return self.answer(qid, CONTROL_INVALID, refusal), []
        aborted = []
        if getattr(msg, "in_flight", FINISH) == ABORT:
            aborted = self._abort("weights updated" if isinstance(msg, UpdateWeights) else "server put to sleep")
        self.queue.append(msg)
        return None, aborted

    def _refusal(self, msg: UpdateWeights | SleepEngine | WakeEngine, live: bool) -> str | None:
        """Why ``msg`` cannot apply (None: it can)."""
        if isinstance(msg, WakeEngine):
            return None
        if msg.in_flight not in IN_FLIGHT_MODES:
            return f"in_flight must be one of {IN_FLIGHT_MODES}, got {msg.in_flight!r}"
        if isinstance(msg, SleepEngine) and msg.level not in (1, 2):
            return f"sleep level must be 1 (the KV cache) or 2 (the KV cache and the weights), got {msg.level}"
        asleep = self.sleep_level or any(isinstance(m, SleepEngine) for m in self.queue)
        if asleep and not any(isinstance(m, WakeEngine) for m in self.queue):
            return "the server is asleep: wake_up first" if isinstance(msg, UpdateWeights) else "already asleep"
        if self.paused and msg.in_flight == FINISH and self.scheduler.state.table.live:
            return (
                f"generation is paused with {len(self.scheduler.state.table.live)} request(s) in flight, which "
                "cannot finish: continue_generation first, or pass in_flight=abort"
            )
        return None

    def _abort(self, why: str) -> list[RequestOutput]:
        """Abort every live request, finish reason ``abort`` with ``why`` as its error."""
        outputs = self.scheduler.abort(list(self.scheduler.state.table.live))
        for out in outputs:
            out.error = f"aborted: {why}"
        return outputs

    def next_command(self, idle: bool) -> tuple[object | None, EngineControlled | None]:
        """With nothing in flight (``idle``): the next command for the worker, or the answer
        of a ``wait`` pause that has now waited; (None, None) when neither."""
        if not idle or self.at_worker is not None or not self.queue:
            return None, None
        msg = self.queue.popleft()
        if isinstance(msg, PauseGeneration):
            self.paused = True
            return None, self.answer(msg.query_id)
        if isinstance(msg, WakeEngine) and not self.sleep_level:
            return None, self.answer(msg.query_id)  # (nothing to wake)
        self.at_worker = msg
        return msg, None

    def worker_answered(self, report: EngineControlled) -> EngineControlled | None:
        """The worker's answer to the command sent: the scheduler's part applied, the answer
        for the frontend (None: it answers no command sent)."""
        msg = self.at_worker
        if msg is None or msg.query_id != report.query_id:
            return None
        self.at_worker = None
        if report.ok:
            if isinstance(msg, UpdateWeights):
                self.weight_version += 1
                self.scheduler.drop_prefix_cache()
            elif isinstance(msg, SleepEngine):
                self.sleep_level = msg.level
                self.scheduler.drop_prefix_cache()
            else:
                self.weight_version += self.sleep_level == 2  # (the weights read again from the checkpoint)
                self.sleep_level = 0
        return self.answer(msg.query_id, report.code, report.error, report.freed_bytes)

    def forget(self, request_ids: list[str]) -> None:
        """Drop held requests the frontend aborted (a client abort, a disconnect): never run."""
        if self.held:
            gone = set(request_ids)
            self.held = [msg for msg in self.held if msg.request_id not in gone]

    def release(self) -> list[AddRequest]:
        """The requests held, once nothing holds them any more."""
        if self.queue or self.at_worker is not None or self.sleep_level or not self.held:
            return []
        held, self.held = self.held, []
        return held
