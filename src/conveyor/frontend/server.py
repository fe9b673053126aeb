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
its requests are dropped on the same path (:meth:`Frontend._note_connection`).

Clients: a request id names a request only within its client. A client is named by
:func:`client_key`: the authenticated CurveZMQ key when authentication is on, else the
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
tokenization is bounded by the model length; an input of :data:`LARGE_INPUT_CHARS` or more
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
with an error naming the schedulers that did not answer within :data:`PROFILE_TIMEOUT_S`.

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
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from conveyor import profiling
from conveyor.frontend.constraints import ConstraintCompiler
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.logprobs import LogprobsLog
from conveyor.frontend.inputs import check_input_chars, context_ids, encode_input, input_chars
from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.frontend.output import OutputPath
from conveyor.frontend.replicas import Gather, ReplicaSet, SchedulerLink, merge_stats, replica_profiles, replica_stats
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.sending import ClientSender
from conveyor.frontend.sessions import Sessions
from conveyor.frontend.stop import StopStringMatcher
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import (
    sequence_id,
    AddRequest,
    FinishReason,
    ProcessFailed,
    ProcessProfile,
    ProfileQuery,
    ProfileReport,
    SchedulerStats,
    Shutdown,
    StatsQuery,
    TokenOutputs,
)
from conveyor.protocol import sampling_fields, wire
from conveyor.protocol import requests as client_requests
from conveyor.protocol import replies
from conveyor.runtime.config import FrontendConfig, replica_of_process

log = logging.getLogger("conveyor.frontend")

PROFILE_TIMEOUT_S = 10.0
# How often the event-loop lag probe wakes: its lag is how late that wake-up comes.
LOOP_LAG_PROBE_S = 0.02
# Scheduler messages handled per wake-up (queued TokenOutputs among them merged into one
# pass) before clients get their turn again: bounds how long a frontend that fell behind
# holds the loop.
SCHEDULER_DRAIN_LIMIT = 16
# Inputs of at least this many characters are tokenized on the one thread of the large-input
# pool (~30 ms of tokenizing and more), so they never hold up the ordinary pool's inputs.
LARGE_INPUT_CHARS = 64 * 1024
# A client frame of at least this many bytes is large: the heap is trimmed after it.
LARGE_FRAME_BYTES = 1 << 20
# At most one heap trim per this many seconds (a trim of a large heap takes milliseconds).
TRIM_INTERVAL_S = 1.0


def client_key(identity: bytes, payload: zmq.Frame) -> bytes:
    """The name of the client that sent ``payload`` with ROUTER routing id ``identity``: a
    request id names a request only within its client. With authentication (CurveZMQ with a
    ZAP handler) the frame carries the authenticated user id (the client's public key), which
    no other client can claim; otherwise the routing identity, which is the connection's own
    unless the client set one (a stable one to continue its requests after a reconnect). The
    prefixes keep the two namespaces apart."""
    try:
        user = payload.get("User-Id")
    except zmq.ZMQError:  # no ZAP handler: no user id on the frame
        user = ""
    return b"key:" + user.encode() if user else b"id:" + identity


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
    """The frontend process's loop: sockets, request intake, and the relays of stats and
    profile queries; the output path is :class:`OutputPath` (see the module docstring)."""

    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.constraints = ConstraintCompiler(config.model_dir)
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
            auth_keys=config.auth_keys,
            send_queue=config.client_send_queue,
            monitor=monitor_addr,
            monitor_events=zmq.EVENT_DISCONNECTED,
        )
        # One scheduler link per data-parallel replica (conveyor.frontend.replicas).
        self.links = [SchedulerLink(self.ctx, addrs.replica(i)) for i in range(config.data_parallel_size)]
        self.replicas = ReplicaSet(self.links, config.max_sessions)
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

    # ------------------------------------------------------------------ client side

    async def _on_monitor_event(self, frames) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._connection_gone(event["value"], "disconnected")

    def _note_connection(self, identity: bytes, fd: int) -> None:
        """Record that the connection on ``fd`` holds routing id ``identity``; if it is the first
        message of a connection that took ``identity`` over from another (ROUTER_HANDOVER), that
        other connection is gone for every purpose of ours.

        libzmq reports nothing on a takeover: the old connection's pipe is terminated, but its
        TCP/ipc connection stays open, answers heartbeats and gets no DISCONNECTED event until
        its client closes it (or sends a message, which libzmq then never reads, so the
        heartbeat drops it ~10 s later). Nothing it sent before can be answered any more: every
        reply under ``identity`` goes to the new connection. The one sign the frontend gets is a
        message under ``identity`` from a new fd, which can only come once the new connection
        holds the routing id; its requests are then aborted like a disconnect's, before this
        message is handled (so a ``generate`` under an id the old connection had in flight is
        the new connection's own request, not a duplicate). A disconnect of ``fd`` is always
        handled before a later connection's first message on the same fd
        (:meth:`_on_client_frames`), so ``fd`` is never mistaken for the connection before it."""
        if self._connections.get(fd) == identity:
            return  # the common case: one dict lookup per message
        for old_fd in [f for f, held in self._connections.items() if held == identity]:
            self._connection_gone(old_fd, "taken over by a new connection under its routing id")
        self._connections[fd] = identity

    def _connection_gone(self, fd: int, why: str) -> None:
        """The connection on ``fd`` can receive nothing more (it disconnected, a newer
        connection took its routing id over, or it stopped reading its replies): drop the
        requests it sent, and only those; a newer connection under the same routing id may have
        requests in flight of its own."""
        self._connections.pop(fd, None)
        victims = [s for s in self.in_flight.values() if s.fd == fd]
        if victims:
            log.info("client connection %s; aborting %d request(s)", why, len(victims))
            self._drop(victims)

    async def _on_client_frames(self, frames) -> None:
        if self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
            # A disconnect queued before this message must be handled first, not after the rest
            # of this drain: its fd may be this message's (closed, then reused by a new client's
            # connection), and the disconnect would then drop the new client's requests too.
            await self._drain(self.monitor, self._on_monitor_event, multipart=True)
        identity = frames[0].bytes
        payload = frames[-1]
        fd = payload.get(zmq.SRCFD)
        self._note_connection(identity, fd)
        self._c_client.add()
        key = client_key(identity, payload)
        size = sum(len(f) for f in frames[1:])
        try:
            if len(frames) != 2:  # DEALER clients send exactly one frame (an empty delimiter is REQ's)
                rid = next(filter(None, (wire.recover_request_id(f.buffer) for f in frames[1:])), None)
                raise wire.FrameError(
                    f"a message is one frame holding a msgpack map; got {len(frames) - 1} frames", rid, wire.BAD_FRAMES
                )
            cmd = client_requests.parse_client_message(wire.unpack_map(payload.buffer))
            if isinstance(cmd, client_requests.GenerateRequest):
                await self._on_generate(identity, fd, key, cmd)
            elif isinstance(cmd, client_requests.AbortCommand):
                await self._on_abort(key, cmd.request_id)
            elif isinstance(cmd, client_requests.ProfileCommand):
                await self._on_profile(identity, cmd)
            elif isinstance(cmd, client_requests.MetricsCommand):
                await self.sender.send(identity, replies.metrics_reply(**self.metrics.snapshot()))
            else:
                query_id = uuid.uuid4().hex
                asked = self.replicas.broadcast(StatsQuery(query_id))  # every live replica
                self._stats_waiters[query_id] = (identity, cmd.iterations, Gather(asked))
        except wire.ProtocolError as exc:
            await self._reply_error(identity, key, exc)
        finally:
            if size >= LARGE_FRAME_BYTES:  # trimmed a moment later, once the drain let go of the frame
                self._schedule_trim()

    async def _on_generate(self, identity: bytes, fd: int, key: bytes, req: client_requests.GenerateRequest) -> None:
        arrival = time.time()
        if (key, req.request_id) in self.in_flight:
            raise wire.ProtocolError(
                f"request id {req.request_id!r} is already in flight; this message was refused, the request goes on",
                req.request_id,
                wire.DUPLICATE_REQUEST_ID,
            )
        logprobs_problem = sampling_fields.logprobs_problem(req.sampling, self.config.max_logprobs)
        if logprobs_problem is not None:
            raise wire.ProtocolError(logprobs_problem, req.request_id)
        history = self.sessions.context((key, req.request_id))
        chars = input_chars(req)
        check_input_chars(
            req, chars, len(history or ()), self.config.max_model_len, self.tokenizer.max_chars_per_token
        )
        state = RequestState(
            request_id=req.request_id,
            scheduler_id=str(next(self._scheduler_ids)),
            identity=identity,
            stream=req.stream,
            prompt_len=0,
            arrival_time=arrival,
            detokenizer=None,
            stop=StopStringMatcher.for_request(req),
            client_key=key,
            fd=fd,
        )
        if req.constraint is None and (self._pool is None or chars < self.config.tokenize_inline_chars):
            prompt_ids, start, end = self._prepare_prompt(req, history, False)
            self._t_tokenize.record(start, end, arg=len(prompt_ids) - len(history or ()))
            self.in_flight[state.key] = state
            self._admit(state, req, history, prompt_ids)
            return
        state.pending = True
        self.in_flight[state.key] = state
        self._c_pooled.add()
        large = chars >= LARGE_INPUT_CHARS
        job = asyncio.ensure_future(self._tokenize_in_pool(state, req, history, large))
        self._tokenizing.add(job)
        job.add_done_callback(self._tokenizing.discard)

    async def _tokenize_in_pool(
        self, state: RequestState, req: client_requests.GenerateRequest, history: list[int] | None, large: bool
    ) -> None:
        """Compile ``req``'s constraint, if it has one, off the loop
        (:mod:`conveyor.frontend.constraints`); tokenize it on a pool thread (``large``: the
        large-input pool's; on the loop without a pool); then admit it unless it was finalized
        meanwhile."""
        loop = asyncio.get_running_loop()
        pool = self._large_pool if large else self._pool
        error = None
        try:
            # A constrained request compiles first (the compiler's pool, bounded by its timeout):
            # a bad constraint is refused before its tokens are ever sent.
            await self.constraints.compile_async(req)
            if pool is None:
                prompt_ids, start, end = self._prepare_prompt(req, history, False)
            else:
                prompt_ids, start, end = await loop.run_in_executor(pool, self._prepare_prompt, req, history, True)
            self._t_tokenize.record(start, end, arg=len(prompt_ids) - len(history or ()))
        except wire.ProtocolError as exc:
            error = exc
        except Exception as exc:  # a bug, not the client's input: still exactly one final
            log.exception("tokenizing request %r failed", req.request_id)
            error = wire.ProtocolError(f"internal error while tokenizing: {exc}", req.request_id, wire.SERVER_ERROR)
        if large:
            self._schedule_trim()
        if self.in_flight.get(state.key) is not state:
            return  # aborted, disconnected or failed meanwhile: the scheduler never heard of it
        if error is not None:
            del self.in_flight[state.key]
            await self._reply_error(state.identity, state.client_key, error)
            return
        self._admit(state, req, history, prompt_ids)

    def _prepare_prompt(
        self, req: client_requests.GenerateRequest, history: list[int] | None, release_gil: bool
    ) -> tuple[list[int], int, int]:
        """The whole context to send (earlier turns + this input), checked against the model's
        limits (:mod:`conveyor.frontend.inputs`), and when its tokenization started and ended
        (ns). Touches no mutable state of the frontend, so it runs on the loop or on a pool thread."""
        start = profiling.now_ns()
        input_ids = encode_input(self.tokenizer, req, continuing=history is not None, release_gil=release_gil)
        end = profiling.now_ns()
        prompt_ids = context_ids(
            req,
            history,
            input_ids,
            vocab_size=self.config.vocab_size,
            max_model_len=self.config.max_model_len,
            tokenizer_vocab_size=self.tokenizer.vocab_size,
        )
        return prompt_ids, start, end

    def _admit(
        self, state: RequestState, req: client_requests.GenerateRequest, history: list[int] | None, prompt_ids: list[int]
    ) -> None:
        """Complete ``state`` (in flight already) with its prompt and send it to the scheduler
        under its scheduler id; from then on the scheduler's outputs find it in :attr:`requests`.

        Synchronous: an abort handled later is queued after the AddRequest."""
        if history is not None:
            self.sessions.take(state.key)  # back (extended) when this turn finishes
        state.prompt_ids = prompt_ids
        state.prompt_len = len(prompt_ids)
        state.max_tokens = req.sampling.max_tokens
        state.history_len = len(history) if history is not None else 0
        state.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, req.skip_special_tokens)
        if req.sampling.n == 1:  # (n > 1 with log-probabilities asked is refused; best_of's are its own)
            state.set_logprobs(req.sampling, self.tokenizer)
        state.keep_best = req.keep_best
        state.pending = False
        self.requests[state.scheduler_id] = state  # (n > 1: where a refusal of the whole request finds it)
        for i in range(req.sampling.n if req.sampling.n > 1 else 0):
            seq = RequestState(
                request_id=state.request_id,
                scheduler_id=sequence_id(state.scheduler_id, i),
                identity=state.identity,
                stream=state.stream,
                prompt_len=state.prompt_len,
                arrival_time=state.arrival_time,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, req.skip_special_tokens),
                stop=StopStringMatcher.for_request(req),
                client_key=state.client_key,
                fd=state.fd,
                index=i,
                parent=state,
                max_tokens=state.max_tokens,
            )
            if req.keep_best is not None:  # its sampled tokens' log-probabilities, kept, never sent
                seq.logprobs = LogprobsLog(0, state.prompt_len, self.tokenizer)
            state.sequences.append(seq)
            self.requests[seq.scheduler_id] = seq
        self.metrics.add_prompt(state.prompt_len)
        add = AddRequest(state.scheduler_id, prompt_ids, req.sampling, state.arrival_time, req.priority, lora=req.lora)
        replica = self.replicas.submit(add, state.key, continuing=history is not None)
        log.debug("request %r is %s at replica %s", state.request_id, state.scheduler_id, replica and replica.index)

    async def _on_abort(self, key: bytes, request_id: str) -> None:
        state = self.in_flight.get((key, request_id))
        if state is None:
            return  # already finished (its final is on the way) or never existed: aborts are idempotent
        self._untrack(state)
        if not state.pending:  # a pending one never reached the scheduler
            self._abort_at_scheduler([state.scheduler_id])
        self.output.finish(state, FinishReason.ABORT)

    def _drop(self, states: list[RequestState]) -> None:
        """Untrack the requests of a client that is gone (no final) and abort those the scheduler has."""
        for state in states:
            self._untrack(state)
            self.metrics.request_finished(FinishReason.ABORT, None, len(state.token_ids), state.prompt_len, state.max_tokens)
        admitted = [s.scheduler_id for s in states if not s.pending]
        if admitted:
            self._abort_at_scheduler(admitted)

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

    # ------------------------------------------------------------------ scheduler side

    async def _drain_scheduler(self, replica: int, sock: zmq.asyncio.Socket) -> None:
        """Handle what replica ``replica``'s scheduler has queued on ``sock`` (at most
        :data:`SCHEDULER_DRAIN_LIMIT` messages per wake-up, so clients are served in between),
        in order. Consecutive TokenOutputs are handled as one: a frontend that fell behind sends
        each stream one delta for all its new tokens instead of one per step, so its cost per
        step drops and it catches up."""
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

    async def _reply_stats(self, query_id: str) -> None:
        """The ``stats`` reply once every replica asked answered (or died): their stats merged
        (:func:`merge_stats`), each replica's own under ``replicas``."""
        identity, iterations, gather = self._stats_waiters.pop(query_id)
        if not gather.answers:
            error = replies.error_map(None, "no scheduler is alive to answer stats", wire.SERVER_ERROR)
            await self.sender.send(identity, error)
            return
        reply = replies.stats_reply(merge_stats(gather.answers), len(self.in_flight), iterations=iterations)
        reply["replicas"] = replica_stats(self.replicas, gather.answers)
        await self.sender.send(identity, reply)

    async def _on_profile(self, identity: bytes, cmd: client_requests.ProfileCommand) -> None:
        """Relay to every live replica's scheduler, which answers with its and its worker's snapshots."""
        query_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        timeout = loop.call_later(PROFILE_TIMEOUT_S, lambda: asyncio.ensure_future(self._reply_profile(query_id, timed_out=True)))
        waiting = self.replicas.broadcast(ProfileQuery(query_id, cmd.window_s, cmd.trace, list(cmd.series)))
        self._profile_waiters[query_id] = (identity, cmd, timeout, Gather(waiting))

    async def _reply_profile(self, query_id: str, timed_out: bool = False) -> None:
        """This process's snapshot, then each replica's processes that answered; on a timeout,
        an error naming the schedulers that did not."""
        waiter = self._profile_waiters.pop(query_id, None)
        if waiter is None:
            return  # answered already (a late report after the timeout, or the reverse)
        identity, cmd, timeout, gather = waiter
        timeout.cancel()
        error = None
        if timed_out and gather.waiting:
            which = "the scheduler" if len(self.replicas) == 1 else f"the scheduler of replica(s) {sorted(gather.waiting)}"
            error = f"{which} did not answer within {PROFILE_TIMEOUT_S:g} s"
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

    async def fail_all(self, reason: str) -> None:
        """Give every in-flight request an error (a peer process died or we are shutting down)."""
        states = list(self.in_flight.values())
        self.in_flight.clear()
        self.requests.clear()
        for state in states:
            self.output.finish(state, FinishReason.ERROR, error=reason)

    async def _on_control(self, frame) -> None:
        try:
            msg = codec.decode(frame.buffer)
        except codec.DecodeError as exc:
            log.error("dropping malformed control message: %s", exc)
            return
        if isinstance(msg, Shutdown):
            log.info("shutting down: %s", msg.reason)
            await self.fail_all(msg.reason)
            self._running = False
        elif isinstance(msg, ProcessFailed):  # bin/serve: a replica died, the others serve on
            replica = replica_of_process(msg.process)
            if replica is not None and replica < len(self.replicas) and self.replicas.replicas[replica].alive:
                await self._on_replica_failed(replica, msg.reason)

    # ------------------------------------------------------------------ sending

    def _abort_at_scheduler(self, request_ids: list[str]) -> None:
        """Abort requests at the replicas that hold them (:meth:`ReplicaSet.abort`)."""
        self.replicas.abort(request_ids)

    async def _reply_error(self, identity: bytes, key: bytes, exc: wire.ProtocolError) -> None:
        """Answer a refused message. A refused ``generate`` whose id could be read ends as that
        request's error ``final``, unless the client has a request in flight under that id (its
        final is still to come: one final per id at a time); a frame that did not decode, or
        that refusal, gets an ``error`` map with the id it carried (None if none was readable)."""
        rid = exc.request_id
        message = str(exc) if rid is not None else f"{exc} (no request_id could be read from this message)"
        if isinstance(exc, wire.FrameError) or (rid is not None and (key, rid) in self.in_flight):
            reply = replies.error_map(rid, message, exc.code)
        else:
            reply = replies.error_reply(rid, message, exc.code)
        await self.sender.send(identity, reply)

    def _schedule_trim(self) -> None:
        """Trim the heap soon (:func:`release_freed_memory`), at most once per
        :data:`TRIM_INTERVAL_S`: after a large frame or input, once what held it is gone."""
        if self._trim_handle is None:
            self._trim_handle = asyncio.get_running_loop().call_later(TRIM_INTERVAL_S, self._trim)

    def _trim(self) -> None:
        self._trim_handle = None
        release_freed_memory()

    def _client_not_reading(self, identity: bytes) -> None:
        """A send to ``identity`` found its connection's send queue full (``--client-send-queue``
        replies waiting, and the socket buffers behind them): the client has stopped reading,
        and every reply it is sent from now on would be held here for as long as its requests
        run. Its connection is treated as gone (:meth:`_connection_gone`: its requests are
        aborted and their KV blocks freed; no final, which could not be queued either) and
        counted. The connection that holds ``identity`` is the one whose queue is full (one
        connection per routing id, :meth:`_note_connection`); none holds it when this
        connection was dropped already, by an earlier send of the same pass: nothing to do."""
        fd = next((f for f, held in self._connections.items() if held == identity), None)
        if fd is None:
            return
        self.metrics.clients_not_reading += 1
        log.warning(
            "client connection %s is not reading its replies (send queue of %d full); dropping its requests",
            identity.hex(),
            self.config.client_send_queue,
        )
        self._connection_gone(fd, "not reading its replies")

    def _client_gone(self, identity: bytes) -> None:
        """A send found the client gone: abort its in-flight requests."""
        victims = [s for s in self.in_flight.values() if s.identity == identity]
        if victims:
            log.info("client gone; aborting %d request(s)", len(victims))
            self._drop(victims)
