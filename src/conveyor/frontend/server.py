"""The frontend process: the client socket, tokenization and streamed detokenization.

One asyncio loop (uvloop) owns every socket of this process and serves them from
a single poller, in a fixed order per wake-up: disconnect events first, then the
control line, then client messages, then scheduler outputs. Handling a client's
disconnect before any message that arrived after it keeps the requests' connections
(:attr:`RequestState.fd`: a disconnect drops the requests its connection sent) honest when
the kernel reuses a file descriptor: ZeroMQ queues the disconnect event
before it closes the fd, so before any message of a later connection on that fd, and
pending disconnect events are also handled before each client message of a drain. A
connection whose routing id a newer connection took over (ROUTER_HANDOVER) is gone for the
frontend too, from the new connection's first message on (libzmq reports no event for it):
its requests are dropped on the same path
(:meth:`~conveyor.frontend.connections.ClientConnections._note_connection`).

This module holds the loop, its sockets and its tables; :class:`Frontend`'s handlers live in
its base classes, one responsibility each: :mod:`conveyor.frontend.intake` (parsing and
admitting client messages), :mod:`conveyor.frontend.connections` (which connection holds which
routing id, and dropping a gone connection's requests) and :mod:`conveyor.frontend.scheduler_side`
(scheduler outputs, the stats and profile relays, replica failures, the control line). The
rules below hold across all of them.

Clients: a request id names a request only within its client. A client is named by
:func:`~conveyor.frontend.intake.client_key`: the authenticated CurveZMQ key when authentication is on, else the
connection's ROUTER routing identity (a client that wants to continue its requests after a
reconnect sets a stable one). Every table about requests (:attr:`Frontend.in_flight`, the
continuation sessions, aborts, the "already in flight" check) is keyed by (client key,
request id) (:attr:`RequestState.key`), so a client can neither abort, continue nor probe
another's request, and two clients may use the same id for two requests.

Request ids: a client names its requests (``request_id``); the scheduler knows each
submission by an id of its own, the next value of a per-frontend counter (``"1"``, ``"2"``,
...), so no two submissions share one, however the client reuses its ids. A client may
reuse an id as soon as its final was sent (a retry after an abort, a continuation after a
stop string), while the scheduler may still send outputs of the earlier request under that
id: the tokens of steps it ran before it read the abort, then the abort's own output. Those
name the earlier scheduler id, find nothing and are dropped, never attributed to the new
request. :attr:`Frontend.in_flight` maps (client key, client id) to requests, :attr:`Frontend.requests`
scheduler ids to the admitted ones (the one lookup a streamed token costs); every message
to the client carries the client's id (``RequestState.request_id``), every message to the
scheduler the scheduler's (``RequestState.scheduler_id``).

Invariants:
- Every request that reached :attr:`Frontend.in_flight` gets exactly one ``final``
  message (or its client is gone), and leaves both tables when it does.
- A request finalized here for any reason other than a scheduler-reported finish
  (client abort, disconnect, stop string) is also aborted at the scheduler, so
  its KV blocks are freed at the next iteration.
- This process never imports torch.
- A client's request id is in :attr:`Frontend.in_flight` from the moment its ``generate``
  arrives, also while its prompt is still being tokenized, so a duplicate from the same
  client is refused at once, with an ``error`` map (code ``duplicate_request_id``), never a
  ``final``: the one final under that id stays the running request's; it is in
  :attr:`Frontend.requests` (under its scheduler id) from its admission on.
- Every client message gets an answer or starts a request that gets its one final: a frame
  that does not decode, a message of other than one frame, a refused duplicate get an
  ``error`` map carrying the request id that could still be read (None when none could); a
  ``generate`` that names a request and is refused gets that request's error ``final``.
- A request whose prompt is still tokenizing in the pool (``pending``) has sent nothing to
  the scheduler. An abort, disconnect or shutdown meanwhile finalizes it here alone (an
  abort or shutdown sends its one ``final``; a gone client gets none) and nothing about it
  ever reaches the scheduler: its tokens are dropped when the pool hands them back. When
  they are ready it is admitted (``pending`` cleared, put in :attr:`Frontend.requests`,
  ``AddRequest`` queued on the socket) with no await in between, so any abort that comes
  after reaches the scheduler after it.
- Continuation: a request that finished (stop, length or abort) leaves its context (prompt
  + the tokens returned to the client) in a bounded LRU of sessions under its client id
  (:mod:`conveyor.frontend.sessions`); a
  new request with that id continues it (under a scheduler id of its own, as every
  submission): its input is appended to that context, only the new output is detokenized
  and returned. The scheduler's prefix cache makes the earlier turns cost nothing to
  recompute when their KV is still cached. Sessions are keyed like :attr:`Frontend.in_flight`,
  so a client continues only its own requests. A continuation that fails (error), or is aborted
  while its input is still tokenizing, leaves the earlier context in place, so the client
  can retry.

Tokenization: an input shorter than ``tokenize_inline_chars`` characters (a prompt, or the
contents of all messages) is tokenized on the loop, since handing it to a thread costs more
(~0.1 ms) than encoding it. A longer one goes to a pool of ``tokenizer_threads`` threads,
where the Rust tokenizer runs with the GIL released (:meth:`Tokenizer.encode` with
``release_gil``), so a 100k-token prompt does not stall every other stream; its request is
sent to the scheduler when its tokens are ready, possibly after shorter requests that came
later (its ``arrival_time`` is still when it came). ``tokenizer_threads=0`` tokenizes
everything on the loop. Bounds: an input longer than the model length times the
vocabulary's longest token (:attr:`Tokenizer.max_chars_per_token`) is refused before it is
tokenized (:func:`~conveyor.frontend.inputs.check_input_chars`), so one request's
tokenization is bounded by the model length; an input of
:data:`~conveyor.frontend.intake.LARGE_INPUT_CHARS` or more
is tokenized on a thread of its own, so large inputs queue behind each other, never in front
of ordinary ones. After a large frame or input the process hands freed heap back to the
system (:func:`release_freed_memory`).

Outputs: scheduler messages are handled synchronously, each delta sent on the raw ROUTER
socket (:mod:`conveyor.frontend.sending` says why that is safe only from the handlers
:meth:`Frontend.run` calls); :mod:`conveyor.frontend.output` turns them into deltas and
finals, one rule for every stream, the streaming hot path included. Scheduler messages that
queued up while the loop was busy are handled as one pass: each stream gets one delta with
all its new tokens, so a frontend that fell behind catches up instead of falling further
behind. Replies are built by :mod:`conveyor.protocol.replies`; requests are validated by
:mod:`conveyor.protocol.requests` (its fields on arrival, its token ids and lengths once
tokenized, :func:`~conveyor.protocol.validation.check_tokenized`).

Metrics (:mod:`conveyor.frontend.request_metrics`): prompt tokens are counted on admission, output
tokens, inter-token gaps and each request's latencies and finish reason on the output path,
a gone client's requests as aborts; a ``metrics`` message is answered here from them (so
they cover every replica's requests).

Profiling (:mod:`conveyor.profiling`): tokenize, detokenize, client sends, the
handling of each scheduler message and the event loop's lag are timed here, and each
request's queue time, TTFT, TPOT and inter-token latencies are recorded when it finishes.
On the hot path detokenize and the inter-token latency are taken for one stream in
:data:`~conveyor.frontend.output.PROFILE_SAMPLE_EVERY`, and client_send once per step (the
mean send of its burst).
A ``profile`` request is relayed to every live replica's scheduler (which adds its worker's
snapshot); the reply carries this process and each replica's two, or those that answered
with an error naming the schedulers that did not answer within
:data:`~conveyor.frontend.scheduler_side.PROFILE_TIMEOUT_S`.

Replicas (:mod:`conveyor.frontend.replicas`): the frontend talks to ``data_parallel_size``
schedulers, one :class:`SchedulerLink` each, and :attr:`Frontend.replicas` decides where
each admitted request goes (a continuation back to its earlier turn's replica), sends its
aborts to that replica alone, and counts what each one holds. A ``stats`` query goes to
every live replica and is answered once each answered or died: the sums, and each
replica's own under ``replicas``. When bin/serve reports a replica dead (``ProcessFailed``
on the control line) its requests get an error final and the others go on; a metrics
message needs no replica, the frontend measures every request itself.
"""


from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import itertools
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio

from conveyor import profiling
from conveyor.frontend.connections import ClientConnections
from conveyor.frontend.constraints import ConstraintCompiler
from conveyor.frontend.intake import LARGE_INPUT_CHARS, ClientIntake
from conveyor.frontend.output import OutputPath
from conveyor.frontend.processor import RequestProcessor
from conveyor.frontend.replicas import Gather, ReplicaSet, SchedulerLink
from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.scheduler_side import LoraWaiter, SchedulerSide
from conveyor.frontend.sending import ClientSender
from conveyor.frontend.sessions import Sessions
from conveyor.frontend.shares import ClientShares
from conveyor.frontend.token_service import TokenService
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc import transport
from conveyor.frontend.liveness import SchedulerWatch
from conveyor.ipc.messages import ProcessProfile, SchedulerStats
from conveyor.protocol import limits
from conveyor.protocol import requests as client_requests
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


class Frontend(ClientIntake, ClientConnections, SchedulerSide):
    """The frontend process's loop, its sockets and its tables of requests (see the module
    docstring). Its handlers come from its base classes, one responsibility each: the client
    intake (:class:`~conveyor.frontend.intake.ClientIntake`), the connection bookkeeping
    (:class:`~conveyor.frontend.connections.ClientConnections`) and the scheduler side with
    the relays of stats and profile queries (:class:`~conveyor.frontend.scheduler_side.SchedulerSide`);
    the output path is :class:`OutputPath`."""

    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.constraints = ConstraintCompiler(config.model_dir)
        self.processor = RequestProcessor(
            tokenizer, vocab_size=config.vocab_size, max_model_len=config.max_model_len, max_logprobs=config.max_logprobs
        )
        # Two views of the requests in flight (module docstring, "Request ids"): by the client's
        # id, every one from its generate on (a pending one too); by its id at the scheduler,
        # those admitted (sent to the scheduler), which is where scheduler outputs look.
        self.in_flight: dict[tuple[bytes, str], RequestState] = {}  # by RequestState.key
        self.requests: dict[str, RequestState] = {}
        # fd -> routing id of each open connection that has sent a message: which connection
        # holds a routing id now (_note_connection), so a takeover drops the old one's requests.
        self._connections: dict[int, bytes] = {}
        self._scheduler_ids = itertools.count(1)  # the next submission's id at the scheduler
        # query id -> (client, iterations asked for, the replicas' answers)
        self._stats_waiters: dict[str, tuple[bytes, bool, Gather[SchedulerStats]]] = {}
        self.sessions = Sessions(config.max_sessions)
        self.shares = ClientShares(config.max_waiting, config.addresses.internal_client)
        # query id -> a load_lora / unload_lora waiting for the replicas; timed-out ones still owed
        self._lora_waiters: dict[str, LoraWaiter] = {}
        self._lora_owed: dict[str, tuple[client_requests.LoraCommand, set[int]]] = {}
        self._profile_waiters: dict[
            str, tuple[bytes, client_requests.ProfileCommand, asyncio.TimerHandle, Gather[list[ProcessProfile]]]
        ] = {}
        self._running = True
        self._pool = (
            ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
            if config.tokenizer_threads
            else None
        )
        self._large_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large") if self._pool else None
        self._tokenizing: set[asyncio.Future] = set()  # pool jobs in flight (kept referenced)
        self._trim_handle: asyncio.TimerHandle | None = None  # a heap trim scheduled (release_freed_memory)

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
        self._exit_code = 0  # set when the frontend stops the server itself (a hung scheduler)
        self.control = transport.socket(self.ctx, zmq.PULL, addrs.frontend_control, bind=True)

        prof = self.profiler = profiling.Profiler("frontend", enabled=config.profile)
        self._t_tokenize = prof.timer("tokenize", arg_name="prompt_tokens")
        self._t_outputs = prof.timer("handle_outputs", arg_name="outputs")
        self.sender = ClientSender(self.clients, self._client_gone, self._client_not_reading, prof)
        self.metrics = FrontendMetrics()  # request-level metrics, read by the ``metrics`` message
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
        self._s_merged = prof.series("merged_steps", "steps")  # behind: steps handled as one
        self._c_client = prof.counter("client_messages")
        self._c_sched = prof.counter("scheduler_messages")
        self._c_tokens = prof.counter("output_tokens")
        self._c_pooled = prof.counter("pooled_tokenizations")
        self.tokens = TokenService(
            self.processor,
            self.sender,
            self._pool,
            self._large_pool,
            inline_chars=config.tokenize_inline_chars,
            large_chars=LARGE_INPUT_CHARS,
            trim=self._schedule_trim,
        )

    async def _probe_loop_lag(self) -> None:
        """How late a timer wakes up: the time any handler holds the loop shows up here."""
        interval_ns = int(LOOP_LAG_PROBE_S * 1e9)
        while self._running:
            start = profiling.now_ns()
            await asyncio.sleep(LOOP_LAG_PROBE_S)
            self._s_loop_lag.add(max(0, profiling.now_ns() - start - interval_ns) / 1e6)

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        if self.profiler.enabled:  # ends with the loop (it checks _running; the runner cancels it)
            self._lag_probe = asyncio.ensure_future(self._probe_loop_lag())
        if self.watch.timeout:  # ends with the loop, as the probe
            self._watchdog = asyncio.ensure_future(self._watch_schedulers())
        poller = zmq.asyncio.Poller()
        for sock in (self.monitor, self.control, self.clients, *(link.from_scheduler for link in self.links)):
            poller.register(sock, zmq.POLLIN)
        while self._running:
            ready = dict(await poller.poll())
            if self.monitor in ready:
                await self._drain(self.monitor, self._on_monitor_event, multipart=True)
            if self.control in ready:
                await self._drain(self.control, self._on_control)
            if self.clients in ready:
                await self._drain(self.clients, self._on_client_frames, multipart=True, limit=256)
            for index, link in enumerate(self.links):
                if link.from_scheduler in ready and self._running:
                    await self._drain_scheduler(index, link.from_scheduler)
        if self._exit_code:
            raise SystemExit(self._exit_code)

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
            if not self._running:
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

    def _schedule_trim(self) -> None:
        """Trim the heap soon (:func:`release_freed_memory`), at most once per
        :data:`TRIM_INTERVAL_S`: after a large frame or input, once what held it is gone."""
        if self._trim_handle is None:
            self._trim_handle = asyncio.get_running_loop().call_later(TRIM_INTERVAL_S, self._trim)

    def _trim(self) -> None:
        self._trim_handle = None
        release_freed_memory()
