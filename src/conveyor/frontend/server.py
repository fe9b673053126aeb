"""The frontend process: the client socket, tokenization and streamed detokenization.

One asyncio loop (uvloop) owns every socket of this process and serves them from
a single poller, in a fixed order per wake-up: disconnect events first, then the
control line, then client messages, then scheduler outputs. Handling a client's
disconnect before any message that arrived after it keeps the fd -> client map
honest when the kernel reuses a file descriptor: ZeroMQ queues the disconnect event
before it closes the fd, so before any message of a later connection on that fd, and
pending disconnect events are also handled before each client message of a drain.

Request ids: a client names its requests (``request_id``); the scheduler knows each
submission by an id of its own, the next value of a per-frontend counter (``"1"``, ``"2"``,
...), so no two submissions share one, however the client reuses its ids. A client may
reuse an id as soon as its final was sent (a retry after an abort, a continuation after a
stop string), while the scheduler may still send outputs of the earlier request under that
id: the tokens of steps it ran before it read the abort, then the abort's own output. Those
name the earlier scheduler id, find nothing and are dropped, never attributed to the new
request. :attr:`Frontend.in_flight` maps client ids to requests, :attr:`Frontend.requests`
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
  arrives, also while its prompt is still being tokenized, so a duplicate is refused at
  once; it is in :attr:`Frontend.requests` (under its scheduler id) from its admission on.
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
  recompute when their KV is still cached. A continuation that fails (error), or is aborted
  while its input is still tokenizing, leaves the earlier context in place, so the client
  can retry.

Tokenization: an input shorter than ``tokenize_inline_chars`` characters (a prompt, or the
contents of all messages) is tokenized on the loop, since handing it to a thread costs more
(~0.1 ms) than encoding it. A longer one goes to a pool of ``tokenizer_threads`` threads,
where the Rust tokenizer runs with the GIL released (:meth:`Tokenizer.encode` with
``release_gil``), so a 100k-token prompt does not stall every other stream; its request is
sent to the scheduler when its tokens are ready, possibly after shorter requests that came
later (its ``arrival_time`` is still when it came). ``tokenizer_threads=0`` tokenizes
everything on the loop.

Outputs: scheduler messages are handled synchronously, each delta sent on the raw ROUTER
socket (:mod:`conveyor.frontend.sending` says why that is safe only from the handlers
:meth:`Frontend.run` calls); :mod:`conveyor.frontend.output` turns them into deltas and
finals, one rule for every stream, the streaming hot path included. Scheduler messages that
queued up while the loop was busy are handled as one pass: each stream gets one delta with
all its new tokens, so a frontend that fell behind catches up instead of falling further
behind. Replies are built by :mod:`conveyor.protocol.replies`; requests are validated by
:mod:`conveyor.protocol.messages` (its fields on arrival, its token ids and lengths once
tokenized, :func:`~conveyor.protocol.messages.check_tokenized`).

Metrics (:mod:`conveyor.frontend.metrics`): prompt tokens are counted on admission, output
tokens, inter-token gaps and each request's latencies and finish reason on the output path,
a gone client's requests as aborts; a ``metrics`` message is answered here from them.

Profiling (:mod:`conveyor.profiling`): tokenize, detokenize, client sends, the
handling of each scheduler message and the event loop's lag are timed here, and each
request's queue time, TTFT, TPOT and inter-token latencies are recorded when it finishes.
On the hot path detokenize and the inter-token latency are taken for one stream in
:data:`~conveyor.frontend.output.PROFILE_SAMPLE_EVERY`, and client_send once per step (the
mean send of its burst).
A ``profile`` request is relayed to the scheduler (which adds the worker's snapshot); the
reply carries all three processes, or this one alone with an error if the scheduler does
not answer within :data:`PROFILE_TIMEOUT_S`.
"""


from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from conveyor import profiling
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.inputs import context_ids, encode_input
from conveyor.frontend.metrics import FrontendMetrics
from conveyor.frontend.output import OutputPath
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.sending import ClientSender
from conveyor.frontend.sessions import Sessions
from conveyor.frontend.stop import StopStringMatcher
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import (
    AbortRequests,
    AddRequest,
    FinishReason,
    ProfileQuery,
    ProfileReport,
    SchedulerStats,
    Shutdown,
    StatsQuery,
    TokenOutputs,
)
from conveyor.protocol import messages as cp
from conveyor.protocol import replies
from conveyor.runtime.config import FrontendConfig

log = logging.getLogger("conveyor.frontend")

PROFILE_TIMEOUT_S = 10.0
# How often the event-loop lag probe wakes: its lag is how late that wake-up comes.
LOOP_LAG_PROBE_S = 0.02
# Scheduler messages handled per wake-up (queued TokenOutputs among them merged into one
# pass) before clients get their turn again: bounds how long a frontend that fell behind
# holds the loop.
SCHEDULER_DRAIN_LIMIT = 16


class Frontend:
    """The frontend process's loop: sockets, request intake, and the relays of stats and
    profile queries; the output path is :class:`OutputPath` (see the module docstring)."""

    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # Two views of the requests in flight (module docstring, "Request ids"): by the client's
        # id, every one from its generate on (a pending one too); by its id at the scheduler,
        # those admitted (sent to the scheduler), which is where scheduler outputs look.
        self.in_flight: dict[str, RequestState] = {}
        self.requests: dict[str, RequestState] = {}
        self._scheduler_ids = itertools.count(1)  # the next submission's id at the scheduler
        self._identities_by_fd: dict[int, set[bytes]] = {}
        self._stats_waiters: dict[str, tuple[bytes, bool]] = {}  # query id -> (client, iterations asked for)
        self.sessions = Sessions(config.max_sessions)
        self._profile_waiters: dict[str, tuple[bytes, cp.ProfileCommand, asyncio.TimerHandle]] = {}
        self._running = True
        self._pool = (
            ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
            if config.tokenizer_threads
            else None
        )
        self._tokenizing: set[asyncio.Future] = set()  # pool jobs in flight (kept referenced)

        self.ctx = zmq.asyncio.Context()
        addrs = config.addresses
        self.clients = self.ctx.socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client raises
        self.clients.setsockopt(zmq.SNDHWM, 0)
        self.clients.setsockopt(zmq.RCVHWM, 0)
        monitor_addr = f"inproc://frontend-monitor-{uuid.uuid4().hex}"
        self.clients.monitor(monitor_addr, zmq.EVENT_DISCONNECTED)
        self.monitor = self.ctx.socket(zmq.PAIR)
        self.monitor.connect(monitor_addr)
        self.clients.bind(addrs.client)
        self.to_scheduler = transport.socket(self.ctx, zmq.PUSH, addrs.to_scheduler, bind=False)
        self.from_scheduler = transport.socket(self.ctx, zmq.PULL, addrs.to_frontend, bind=True)
        self.control = transport.socket(self.ctx, zmq.PULL, addrs.frontend_control, bind=True)
        # A synchronous view: an awaited send of the asyncio wrapper costs several times a raw
        # one, and ``to_scheduler`` is never polled, so a raw send is safe from anywhere.
        self._to_scheduler_raw = zmq.Socket.shadow(self.to_scheduler.underlying)

        prof = self.profiler = profiling.Profiler("frontend", enabled=config.profile)
        self._t_tokenize = prof.timer("tokenize", arg_name="prompt_tokens")
        self._t_outputs = prof.timer("handle_outputs", arg_name="outputs")
        self.sender = ClientSender(self.clients, self._client_gone, prof)
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
        for sock in (self.monitor, self.control, self.clients, self.from_scheduler):
            poller.register(sock, zmq.POLLIN)
        while self._running:
            ready = dict(await poller.poll())
            if self.monitor in ready:
                await self._drain(self.monitor, self._on_monitor_event, multipart=True)
            if self.control in ready:
                await self._drain(self.control, self._on_control)
            if self.clients in ready:
                await self._drain(self.clients, self._on_client_frames, multipart=True, limit=256)
            if self.from_scheduler in ready:
                await self._drain_scheduler()

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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for sock in (self.clients, self.monitor, self.to_scheduler, self.from_scheduler, self.control):
            sock.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ client side

    async def _on_monitor_event(self, frames) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        gone = self._identities_by_fd.pop(event["value"], set())
        victims = [s for s in self.in_flight.values() if s.identity in gone]
        if victims:
            log.info("client disconnected; aborting %d request(s)", len(victims))
            self._drop(victims)

    async def _on_client_frames(self, frames) -> None:
        if self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
            # A disconnect queued before this message must be handled first, not after the rest
            # of this drain: its fd may be this message's (closed, then reused by a new client's
            # connection), and the disconnect would then drop the new client's requests too.
            await self._drain(self.monitor, self._on_monitor_event, multipart=True)
        if len(frames) != 2:
            return  # DEALER clients send exactly one frame; anything else has no reply path
        identity = frames[0].bytes
        payload = frames[1]
        fd = payload.get(zmq.SRCFD)
        self._identities_by_fd.setdefault(fd, set()).add(identity)
        self._c_client.add()
        try:
            cmd = cp.parse_client_message(cp.unpack_map(payload.bytes))
            if isinstance(cmd, cp.GenerateRequest):
                await self._on_generate(identity, cmd)
            elif isinstance(cmd, cp.AbortCommand):
                await self._on_abort(cmd.request_id)
            elif isinstance(cmd, cp.ProfileCommand):
                await self._on_profile(identity, cmd)
            elif isinstance(cmd, cp.MetricsCommand):
                await self.sender.send(identity, replies.metrics_reply(**self.metrics.snapshot()))
            else:
                query_id = uuid.uuid4().hex
                self._stats_waiters[query_id] = (identity, cmd.iterations)
                self._send_scheduler(StatsQuery(query_id))
        except cp.ProtocolError as exc:
            await self._reply_error(identity, exc.request_id, str(exc))

    async def _on_generate(self, identity: bytes, req: cp.GenerateRequest) -> None:
        arrival = time.time()
        if req.request_id in self.in_flight:
            raise cp.ProtocolError(f"request id {req.request_id!r} is already in flight", req.request_id)
        history = self.sessions.context(req.request_id)
        state = RequestState(
            request_id=req.request_id,
            scheduler_id=str(next(self._scheduler_ids)),
            identity=identity,
            stream=req.stream,
            prompt_len=0,
            arrival_time=arrival,
            detokenizer=None,
            stop=StopStringMatcher(req.stop),
        )
        if self._pool is None or _input_chars(req) < self.config.tokenize_inline_chars:
            prompt_ids, start, end = self._prepare_prompt(req, history, False)
            self._t_tokenize.record(start, end, arg=len(prompt_ids) - len(history or ()))
            self.in_flight[req.request_id] = state
            self._admit(state, req, history, prompt_ids)
            return
        state.pending = True
        self.in_flight[req.request_id] = state
        self._c_pooled.add()
        job = asyncio.ensure_future(self._tokenize_in_pool(state, req, history))
        self._tokenizing.add(job)
        job.add_done_callback(self._tokenizing.discard)

    async def _tokenize_in_pool(self, state: RequestState, req: cp.GenerateRequest, history: list[int] | None) -> None:
        """Tokenize ``req`` on a pool thread, then admit it unless it was finalized meanwhile."""
        loop = asyncio.get_running_loop()
        error = None
        try:
            prompt_ids, start, end = await loop.run_in_executor(self._pool, self._prepare_prompt, req, history, True)
            self._t_tokenize.record(start, end, arg=len(prompt_ids) - len(history or ()))
        except cp.ProtocolError as exc:
            error = str(exc)
        except Exception as exc:  # a bug, not the client's input: still exactly one final
            log.exception("tokenizing request %r failed", req.request_id)
            error = f"internal error while tokenizing: {exc}"
        if self.in_flight.get(req.request_id) is not state:
            return  # aborted, disconnected or failed meanwhile: the scheduler never heard of it
        if error is not None:
            del self.in_flight[req.request_id]
            await self._reply_error(state.identity, req.request_id, error)
            return
        self._admit(state, req, history, prompt_ids)

    def _prepare_prompt(
        self, req: cp.GenerateRequest, history: list[int] | None, release_gil: bool
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
        self, state: RequestState, req: cp.GenerateRequest, history: list[int] | None, prompt_ids: list[int]
    ) -> None:
        """Complete ``state`` (in flight already) with its prompt and send it to the scheduler
        under its scheduler id; from then on the scheduler's outputs find it in :attr:`requests`.

        Synchronous: an abort handled later is queued after the AddRequest."""
        if history is not None:
            self.sessions.take(req.request_id)  # back (extended) when this turn finishes
        state.prompt_ids = prompt_ids
        state.prompt_len = len(prompt_ids)
        state.history_len = len(history) if history is not None else 0
        state.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        state.pending = False
        self.requests[state.scheduler_id] = state
        self.metrics.add_prompt(state.prompt_len)
        log.debug("request %r is %s at the scheduler", state.request_id, state.scheduler_id)
        self._send_scheduler(AddRequest(state.scheduler_id, prompt_ids, req.sampling, state.arrival_time, req.priority))

    async def _on_abort(self, request_id: str) -> None:
        state = self.in_flight.get(request_id)
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
            self.metrics.request_finished(FinishReason.ABORT, None, len(state.token_ids))
        admitted = [s.scheduler_id for s in states if not s.pending]
        if admitted:
            self._abort_at_scheduler(admitted)

    def _untrack(self, state: RequestState) -> None:
        """Forget a request that is being finalized: from here on its client id may be used
        again, and whatever the scheduler still sends under its scheduler id is dropped."""
        self.requests.pop(state.scheduler_id, None)  # absent while pending
        if self.in_flight.get(state.request_id) is state:  # absent in a hand-built table (bench)
            del self.in_flight[state.request_id]

    # ------------------------------------------------------------------ scheduler side

    async def _drain_scheduler(self) -> None:
        """Handle what the scheduler has queued (at most :data:`SCHEDULER_DRAIN_LIMIT` messages
        per wake-up, so clients are served in between), in order. Consecutive TokenOutputs are
        handled as one: a frontend that fell behind sends each stream one delta for all its
        new tokens instead of one per step, so its cost per step drops and it catches up."""
        batch: list[TokenOutputs] = []
        for _ in range(SCHEDULER_DRAIN_LIMIT):
            try:
                frame = await self.from_scheduler.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = codec.decode(frame.buffer)
            except codec.DecodeError as exc:
                log.error("dropping malformed message from scheduler: %s", exc)
                continue
            self._c_sched.add()
            if isinstance(msg, TokenOutputs):
                batch.append(msg)
                continue
            if batch:
                self._on_token_outputs(batch)
                batch = []
            await self._on_scheduler_message(msg)
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

    async def _on_scheduler_message(self, msg) -> None:
        """A scheduler message other than TokenOutputs."""
        if isinstance(msg, ProfileReport):
            await self._reply_profile(msg.query_id, msg.profiles)
        elif isinstance(msg, SchedulerStats):
            waiter = self._stats_waiters.pop(msg.query_id, None)
            if waiter is not None:
                identity, iterations = waiter
                await self.sender.send(identity, replies.stats_reply(msg, len(self.in_flight), iterations=iterations))

    async def _on_profile(self, identity: bytes, cmd: cp.ProfileCommand) -> None:
        """Relay to the scheduler, which answers with its and the worker's snapshots."""
        query_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        timeout = loop.call_later(
            PROFILE_TIMEOUT_S,
            lambda: asyncio.ensure_future(
                self._reply_profile(query_id, [], error=f"the scheduler did not answer within {PROFILE_TIMEOUT_S:g} s")
            ),
        )
        self._profile_waiters[query_id] = (identity, cmd, timeout)
        self._send_scheduler(ProfileQuery(query_id, cmd.window_s, cmd.trace, list(cmd.series)))

    async def _reply_profile(self, query_id: str, others: list, error: str | None = None) -> None:
        waiter = self._profile_waiters.pop(query_id, None)
        if waiter is None:
            return  # answered already (a late report after the timeout, or the reverse)
        identity, cmd, timeout = waiter
        timeout.cancel()
        own = self.profiler.snapshot(cmd.window_s, trace=cmd.trace, series=cmd.series)
        processes = [profiling.profile_to_map(p) for p in (own, *others)]
        await self.sender.send(identity, replies.profile_reply(profiling.CLOCK_NAME, cmd.window_s, processes, error))

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

    # ------------------------------------------------------------------ sending

    def _abort_at_scheduler(self, request_ids: list[str]) -> None:
        self._send_scheduler(AbortRequests(request_ids))

    def _send_scheduler(self, msg) -> None:
        self._to_scheduler_raw.send(codec.encode(msg), copy=False)

    async def _reply_error(self, identity: bytes, request_id: str | None, message: str) -> None:
        await self.sender.send(identity, replies.error_reply(request_id, message))

    def _client_gone(self, identity: bytes) -> None:
        """A send found the client gone: abort its in-flight requests."""
        victims = [s for s in self.in_flight.values() if s.identity == identity]
        if victims:
            log.info("client gone; aborting %d request(s)", len(victims))
            self._drop(victims)


def _input_chars(req: cp.GenerateRequest) -> int:
    """Characters to tokenize: the prompt, or every string in the messages (0 for token ids)."""
    if req.prompt is not None:
        return len(req.prompt)
    return _text_len(req.messages) if req.messages is not None else 0


def _text_len(value, depth: int = 4) -> int:
    """Total length of the strings in ``value`` down to ``depth`` levels (messages, their
    fields, parts of a content list, ...): an estimate, deep enough for any chat template."""
    if isinstance(value, str):
        return len(value)
    if depth == 0:
        return 0
    if isinstance(value, dict):
        return sum(_text_len(v, depth - 1) for v in value.values())
    if isinstance(value, list):
        return sum(_text_len(v, depth - 1) for v in value)
    return 0

