"""The frontend process: the client socket, tokenization and streamed detokenization.

:class:`Frontend` holds the loop, its sockets and its tables; its handlers are in ``intake.py``,
``connections.py`` and ``scheduler_side.py``. The rules they keep together (clients, request
ids, the one-final invariants, continuation, tokenization, outputs, replicas) are in
docs/architecture.md, "The frontend's rules"."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio

from conveyor import profiling
from conveyor.frontend.connections import ClientConnections
from conveyor.frontend.constraints import ConstraintCompiler
from conveyor.frontend.intake import LARGE_INPUT_CHARS, ClientIntake, IntakeParts
from conveyor.frontend.liveness import SchedulerWatch
from conveyor.frontend.output import OutputPath
from conveyor.frontend.processor import RequestProcessor
from conveyor.frontend.relays import Relays
from conveyor.frontend.replicas import ReplicaSet, SchedulerLink
from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.scheduler_side import LoopState, SchedulerSide
from conveyor.frontend.sending import ClientSender
from conveyor.frontend.sessions import Sessions
from conveyor.frontend.shares import ClientShares
from conveyor.frontend.token_service import TokenService
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc import transport
from conveyor.protocol import limits
from conveyor.runtime.config import FrontendConfig

log = logging.getLogger("conveyor.frontend")

# How often the event-loop lag probe wakes: its lag is how late that wake-up comes.
LOOP_LAG_PROBE_S = 0.02
# At most one heap trim per this many seconds (a trim of a large heap takes milliseconds).
TRIM_INTERVAL_S = 1.0


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only


def release_freed_memory() -> None:
    """Hand the heap memory freed since the last call back to the system (glibc's
    ``malloc_trim``; nothing elsewhere). A large frame or input is decoded, tokenized and
    dropped in pieces across the loop's and the pool's malloc arenas; freed, those pages stay
    in the arenas (the process's RSS) until a trim, so without one a burst of large inputs
    left the frontend at several times its idle RSS for good."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class Frontend:
    """The frontend process's loop, its sockets and its tables of requests, and the parts it
    holds, each built from what it needs: the client intake (``intake``), the scheduler side
    (``scheduler_side``), the request processor (``processor``), the connection bookkeeping
    (``connections``), the query relays (``relays``), ``tokenize`` / ``detokenize``
    (``tokens``), the client shares (``shares``) and the output path (``output``)."""

    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.constraints = ConstraintCompiler(config.model_dir)
        self.processor = RequestProcessor(
            tokenizer,
            vocab_size=config.vocab_size,
            max_model_len=config.max_model_len,
            max_logprobs=config.max_logprobs,
        )
        # Two views of the requests in flight (docs/architecture.md, "The frontend's rules"): by the client's
        # id, every one from its generate on (a pending one too); by its id at the scheduler,
        # those admitted (sent to the scheduler), which is where scheduler outputs look.
        self.in_flight: dict[tuple[bytes, str], RequestState] = {}  # by RequestState.key
        self.requests: dict[str, RequestState] = {}
        self.sessions = Sessions(config.max_sessions)
        self.shares = ClientShares(config.max_waiting, config.addresses.internal_client)
        self.loop = LoopState()
        self._pool = (
            ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
            if config.tokenizer_threads
            else None
        )
        self._large_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large") if self._pool else None
        self._trim_handle: asyncio.TimerHandle | None = None  # a heap trim scheduled (release_freed_memory)

        self._open_sockets(config)
        self._build_parts(config)

    def _open_sockets(self, config: FrontendConfig) -> None:
        """The client ROUTER (and its disconnect monitor), the replicas' links, the control line."""
        self.ctx = zmq.asyncio.Context()
        addrs = config.addresses
        monitor_addr = f"inproc://frontend-monitor-{uuid.uuid4().hex}"
        self.monitor = self.ctx.socket(zmq.PAIR)
        self.monitor.connect(monitor_addr)  # (inproc: before the bind is fine)
        # Limits, heartbeats, handover and --auth-keys: transport.bind_client_socket says which.
        self.clients, self._authenticator = transport.bind_client_socket(
            self.ctx,
            addrs.client,
            max_message_bytes=limits.MAX_CLIENT_MESSAGE_BYTES,
            auth_keys=config.auth_keys,
            send_queue=config.client_send_queue,
            internal=addrs.internal_client,
            monitor=monitor_addr,
            monitor_events=zmq.EVENT_DISCONNECTED,
        )
        # One scheduler link per data-parallel replica (conveyor.frontend.replicas).
        self.links = [SchedulerLink(self.ctx, addrs.replica(i)) for i in range(config.data_parallel_size)]
        self.replicas = ReplicaSet(self.links, config.max_sessions)
        self.watch = SchedulerWatch(config.hang_timeout, config.on_hang, self.replicas)
        self.control = transport.socket(self.ctx, zmq.PULL, addrs.frontend_control, bind=True)

    def _build_parts(self, config: FrontendConfig) -> None:
        """The parts the handlers are, each given what it works with."""
        prof = self.profiler = profiling.Profiler("frontend", enabled=config.profile)
        self.metrics = FrontendMetrics()  # request-level metrics, read by the ``metrics`` message
        self.connections = ClientConnections(
            self.in_flight, self.metrics, self.shares, self._untrack, self._abort_at_scheduler, config.client_send_queue
        )
        self.sender = ClientSender(self.clients, self.connections.client_gone, self.connections.not_reading, prof)
        self.relays = Relays(
            self.replicas, self.sender, self.in_flight, prof, config.enable_lora_loading, config.enable_rl_control
        )
        self.output = OutputPath(
            self.requests,
            self.sender,
            self.sessions,
            prof,
            untrack=self._untrack,
            abort=self._abort_at_scheduler,
            metrics=self.metrics,
        )
        self._s_loop_lag = prof.series("event_loop_lag", "ms")
        self.tokens = TokenService(
            self.processor,
            self.sender,
            self._pool,
            self._large_pool,
            inline_chars=config.tokenize_inline_chars,
            large_chars=LARGE_INPUT_CHARS,
            trim=self._schedule_trim,
        )
        self.scheduler_side = SchedulerSide(
            self.loop,
            self.in_flight,
            self.requests,
            (self.shares, self.replicas, self.watch, self.output, self.relays),
            prof,
            untrack=self._untrack,
            ctx=self.ctx,
            control_address=config.addresses.frontend_control,
        )
        parts = IntakeParts(
            config, self.processor, self.constraints, self.in_flight, self.requests, self.sessions, self.shares,
            self.replicas, self.watch, self.sender, self.output, self.metrics, self.connections, self.relays,
            self.tokens,
            self._pool, self._large_pool,
        )  # fmt: skip
        self.intake = ClientIntake(
            parts,
            prof,
            drain_disconnects=self._drain_disconnects,
            untrack=self._untrack,
            abort=self._abort_at_scheduler,
            schedule_trim=self._schedule_trim,
        )

    async def _probe_loop_lag(self) -> None:
        """How late a timer wakes up: the time any handler holds the loop shows up here."""
        interval_ns = int(LOOP_LAG_PROBE_S * 1e9)
        while self.loop.running:
            start = profiling.now_ns()
            await asyncio.sleep(LOOP_LAG_PROBE_S)
            self._s_loop_lag.add(max(0, profiling.now_ns() - start - interval_ns) / 1e6)

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        if self.profiler.enabled:  # ends with the loop (it checks loop.running; the runner cancels it)
            self._lag_probe = asyncio.ensure_future(self._probe_loop_lag())
        if self.watch.timeout:  # ends with the loop, as the probe
            self._watchdog = asyncio.ensure_future(self.scheduler_side.watch_schedulers())
        poller = zmq.asyncio.Poller()
        for sock in (self.monitor, self.control, self.clients, *(link.from_scheduler for link in self.links)):
            poller.register(sock, zmq.POLLIN)
        while self.loop.running:
            ready = dict(await poller.poll())
            if self.monitor in ready:
                await self._drain(self.monitor, self.connections.on_monitor_event, multipart=True)
            if self.control in ready:
                await self._drain(self.control, self.scheduler_side.on_control)
            if self.clients in ready:
                await self._drain(self.clients, self.intake.on_client_frames, multipart=True, limit=256)
            for index, link in enumerate(self.links):
                if link.from_scheduler in ready and self.loop.running:
                    await self.scheduler_side.drain(index, link.from_scheduler)
        if self.loop.exit_code:
            raise SystemExit(self.loop.exit_code)

    async def _drain(self, sock: zmq.asyncio.Socket, handler, *, multipart: bool = False, limit: int = 1024) -> None:
        for _ in range(limit):
            try:
                if multipart:
                    msg = await sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                else:
                    msg = await sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            await handler(msg)
            if not self.loop.running:
                return

    def close(self) -> None:
        self.constraints.close()
        for pool in (self._pool, self._large_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.clients.close()  # its own linger: the finals of a shutdown still go out (transport.CLIENT_LINGER_MS)
        for sock in (self.monitor, self.control):
            sock.close(linger=0)
        for link in self.links:
            link.close()
        if self._authenticator is not None:  # its ZAP sockets would keep term() waiting
            self._authenticator.stop()
        self.ctx.term()

    # ------------------------------------------------------------------ shared by the handlers

    def _untrack(self, state: RequestState) -> None:
        """Forget a request that is being finalized: from here on its client id may be used
        again, and whatever the scheduler still sends under its scheduler id is dropped. A
        sequence of an ``n`` > 1 request is forgotten alone (its request stays in flight until
        its final); the request takes its sequences with it."""
        self.requests.pop(state.scheduler_id, None)  # absent while pending
        if state.parent is not None:
            return
        for seq in state.sequences:
            self.requests.pop(seq.scheduler_id, None)
        if self.in_flight.get(state.key) is state:  # absent in a hand-built table (bench)
            del self.in_flight[state.key]
            self.shares.give_back(state.client_key, state.share)

    async def _drain_disconnects(self) -> None:
        """Handle the disconnect events queued so far (before a client message: see the intake)."""
        if self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
            await self._drain(self.monitor, self.connections.on_monitor_event, multipart=True)

    def _abort_at_scheduler(self, request_ids: list[str]) -> None:
        """Abort requests at the replicas that hold them (:meth:`ReplicaSet.abort`)."""
        self.replicas.abort(request_ids)

    async def fail_all(self, reason: str) -> None:
        """Every in-flight request and waiting query answered with ``reason`` as its error
        (:meth:`SchedulerSide.fail_all`)."""
        await self.scheduler_side.fail_all(reason)

    def _schedule_trim(self) -> None:
        """Trim the heap soon (:func:`release_freed_memory`), at most once per
        :data:`TRIM_INTERVAL_S`: after a large frame or input, once what held it is gone."""
        if self._trim_handle is None:
            self._trim_handle = asyncio.get_running_loop().call_later(TRIM_INTERVAL_S, self._trim)

    def _trim(self) -> None:
        self._trim_handle = None
        release_freed_memory()
