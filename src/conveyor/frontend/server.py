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
  + the tokens returned to the client) in a bounded LRU of sessions under its client id; a
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

Streaming hot path: one scheduler message (a token for every running stream) is handled
synchronously, each delta sent on the raw ROUTER socket (see ``_clients_raw`` for why that
is safe only from the handlers :meth:`Frontend.run` calls). The plain next tokens of a step
(its columns) go through :meth:`Frontend._on_next_tokens` in two passes, every stream's text
and delta bytes first, then the sends back to back; a token costs a memo lookup in the
detokenizer for most text (``IncrementalDetokenizer``'s fast paths), no stop-string scan
unless the request has stop strings, a delta assembled from bytes packed once per request
and once per token, and two calls of the backend's send. Docs: docs/benchmarks.md,
"Frontend under load"; ``bench/frontend_step.py`` measures this path alone. Scheduler
messages that queued up while the loop was busy are handled as one pass: each stream gets
one delta with all its new tokens (a stop string still ends the output at the token that
completes it), so a frontend that fell behind catches up instead of falling further behind.

Profiling (:mod:`conveyor.profiling`): tokenize, detokenize, client sends, the
handling of each scheduler message and the event loop's lag are timed here, and each
request's queue time, TTFT, TPOT and inter-token latencies are recorded when it finishes.
On the hot path detokenize and the inter-token latency are taken for one stream in
:data:`PROFILE_SAMPLE_EVERY`, and client_send once per step (the mean send of its burst).
A ``profile`` request is relayed to the scheduler (which adds the worker's snapshot); the
reply carries all three processes, or this one alone with an error if the scheduler does
not answer within :data:`PROFILE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from conveyor.protocol import messages as cp
from conveyor import profiling
from conveyor.ipc import codec, transport
from conveyor.ipc.messages import (
    AbortRequests,
    AddRequest,
    FinishReason,
    ProfileQuery,
    ProfileReport,
    RequestOutput,
    SchedulerStats,
    Shutdown,
    StatsQuery,
    TokenOutputs,
)
from conveyor.ipc.transport import ServerAddresses
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.stop import StopStringMatcher
from conveyor.frontend.tokenizer import Tokenizer

log = logging.getLogger("conveyor.frontend")

PROFILE_TIMEOUT_S = 10.0
# How often the event-loop lag probe wakes: its lag is how late that wake-up comes.
LOOP_LAG_PROBE_S = 0.02
# Scheduler messages handled per wake-up (queued TokenOutputs among them merged into one
# pass) before clients get their turn again: bounds how long a frontend that fell behind
# holds the loop.
SCHEDULER_DRAIN_LIMIT = 16
# Streaming hot path: one stream in this many gets its detokenize and client_send timed and
# its inter-token latency recorded (timing every stream cost more than a microsecond per token).
PROFILE_SAMPLE_EVERY = 16
# Entries of the per-token delta tails memo (Frontend._delta_tails). Bounded by the vocabulary
# alone it grew to ~27 MB for a 151k vocabulary once every token had been streamed (~180 bytes a
# token: int key, tuple, packed tail); 32768 entries (~6 MB) hold the tokens of ordinary text. Past
# the cap the older half is dropped (_drop_older_half); a miss costs a few hundred nanoseconds.
DELTA_TAILS_MAX = 32768

# A delta is the map {type, v, request_id, text, token_ids}, packed by msgpack in that order.
# Its bytes up to the text's value are fixed per request (RequestState.delta_head), so a delta
# is that head + the packed text + _DELTA_IDS_KEY + the packed ids: the same bytes as
# cp.pack of the map, without building the map.
_DELTA_PREFIX = b"\x85" + b"".join(
    msgpack.packb(x) for x in ("type", cp.DELTA, "v", cp.CLIENT_PROTOCOL_VERSION, "request_id")
)
_DELTA_TEXT_KEY = msgpack.packb("text")
_DELTA_IDS_KEY = msgpack.packb("token_ids")
# The backend's send, without pyzmq's pure-Python wrapper around it (same call for bytes with
# copy=True; that wrapper cost about a microsecond per call on the hot path).
_zmq_send = zmq.backend.Socket.send


def delta_head(request_id: str) -> bytes:
    """The packed bytes of a delta for ``request_id`` up to its text's value."""
    return _DELTA_PREFIX + msgpack.packb(request_id, use_bin_type=True) + _DELTA_TEXT_KEY


@dataclass(frozen=True)
class FrontendConfig:
    model_dir: str
    addresses: ServerAddresses
    max_model_len: int
    vocab_size: int  # rows of the model's embedding: token ids must be below it
    # Finished requests remembered for continuation (their token ids, up to max_model_len each).
    max_sessions: int = 1024
    profile: bool = True  # record latency profiles (bin/serve --profile / --no-profile)
    # Threads that tokenize long inputs off the event loop (0: everything on the loop).
    tokenizer_threads: int = 2
    # Inputs shorter than this many characters are tokenized on the loop (a thread hop costs more).
    tokenize_inline_chars: int = 512

    def __post_init__(self) -> None:
        if self.tokenizer_threads < 0:
            raise ValueError(f"tokenizer_threads must be >= 0, got {self.tokenizer_threads}")
        if self.tokenize_inline_chars < 0:
            raise ValueError(f"tokenize_inline_chars must be >= 0, got {self.tokenize_inline_chars}")


@dataclass
class RequestState:
    """What the frontend tracks for one in-flight request.

    ``request_id`` is the client's id (every message the client gets carries it);
    ``scheduler_id`` the id this submission has at the scheduler, unique per submission
    (see :class:`Frontend`). A state built without one (``bench/frontend_step.py`` fills
    :attr:`Frontend.requests` by hand) is known to the scheduler by its client id."""

    request_id: str
    identity: bytes
    fd: int
    stream: bool
    prompt_len: int
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None  # None while pending
    stop: StopStringMatcher
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_output_ns: int = 0  # CLOCK_MONOTONIC of the last output with tokens (inter-token latency)
    prompt_ids: list[int] = field(default_factory=list)  # the whole context, earlier turns included
    history_len: int = 0  # how much of prompt_ids a continued request's earlier turns make up
    cached_tokens: int = 0  # prompt tokens whose KV the scheduler reused
    pending: bool = False  # prompt still tokenizing in the pool: the scheduler has not seen it
    delta_head: bytes = b""  # set from request_id: every delta's bytes up to its text
    has_stop: bool = False  # set from stop: the request has stop strings to look for
    scheduler_id: str = ""  # its id at the scheduler ("" in a hand-built state: request_id)

    def __post_init__(self) -> None:
        if not self.scheduler_id:
            self.scheduler_id = self.request_id
        self.delta_head = delta_head(self.request_id)
        self.has_stop = self.stop.active


class Frontend:
    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # Ids from the tokenizer need no vocabulary check unless the model has fewer rows than it has tokens.
        self._tokenizer_exceeds_model = tokenizer.vocab_size > config.vocab_size
        # Two views of the requests in flight (module docstring, "Request ids"): by the client's
        # id, every one from its generate on (a pending one too); by its id at the scheduler,
        # those admitted (sent to the scheduler), which is where scheduler outputs look.
        self.in_flight: dict[str, RequestState] = {}
        self.requests: dict[str, RequestState] = {}
        self._scheduler_ids = itertools.count(1)  # the next submission's id at the scheduler
        self._identities_by_fd: dict[int, set[bytes]] = {}
        self._stats_waiters: dict[str, bytes] = {}
        # client request id -> context (prompt + returned tokens) of its last finished turn, LRU first.
        self._sessions: OrderedDict[str, list[int]] = OrderedDict()
        self._profile_waiters: dict[str, tuple[bytes, cp.ProfileCommand, asyncio.TimerHandle]] = {}
        self._running = True
        self._init_profiling(config.profile)
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
        # Synchronous views of two sockets for the hot path (an awaited send of the asyncio
        # wrapper costs several times a raw one). A raw send on ``clients`` can consume the
        # edge-triggered wake-up of client messages that arrive meanwhile; :meth:`run`
        # re-checks every socket each time it polls, so raw sends from the handlers it calls
        # are safe, but anything else (tasks, timers) sends through :meth:`_send_client`,
        # whose asyncio socket re-checks. ``to_scheduler`` is never polled: raw is safe anywhere.
        self._clients_raw = zmq.Socket.shadow(self.clients.underlying)
        self._to_scheduler_raw = zmq.Socket.shadow(self.to_scheduler.underlying)
        self._packer = msgpack.Packer(use_bin_type=True)  # cp.pack's format, without a Packer per call
        # token id -> (text, packed text + ids key + packed [id]): the tail of a one-token delta
        # whose text is ``text`` (the text is mostly the token's own). At most DELTA_TAILS_MAX
        # entries: a hit is one dict lookup, as before; only a miss past the cap drops entries.
        self._delta_tails: dict[int, tuple[str, bytes]] = {}
        self._sample_countdown = 1  # streams until the hot path times one (PROFILE_SAMPLE_EVERY)

    def _init_profiling(self, enabled: bool) -> None:
        prof = self.profiler = profiling.Profiler("frontend", enabled=enabled)
        self._t_tokenize = prof.timer("tokenize", arg_name="prompt_tokens")
        self._t_outputs = prof.timer("handle_outputs", arg_name="outputs")
        # Per token of each request: kept out of the bounded trace, which would fill at once.
        self._t_detokenize = prof.timer("detokenize", trace=False)
        self._t_send = prof.timer("client_send", trace=False)
        self._s_loop_lag = prof.series("event_loop_lag", "ms")
        self._s_merged = prof.series("merged_steps", "steps")  # behind: steps handled as one
        self._s_queue = prof.series("request_queue_time", "ms")
        self._s_ttft = prof.series("request_ttft", "ms")
        self._s_tpot = prof.series("request_tpot", "ms")
        self._s_e2e = prof.series("request_e2e", "ms")
        self._s_itl = prof.series("request_itl", "ms", capacity=4 * prof.capacity)
        self._c_client = prof.counter("client_messages")
        self._c_sched = prof.counter("scheduler_messages")
        self._c_tokens = prof.counter("output_tokens")
        self._c_finished = prof.counter("finished_requests")
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
                await self._on_generate(identity, fd, cmd)
            elif isinstance(cmd, cp.AbortCommand):
                await self._on_abort(cmd.request_id)
            elif isinstance(cmd, cp.ProfileCommand):
                await self._on_profile(identity, cmd)
            else:
                query_id = uuid.uuid4().hex
                self._stats_waiters[query_id] = identity
                self._send_scheduler(StatsQuery(query_id))
        except cp.ProtocolError as exc:
            await self._reply_error(identity, exc.request_id, str(exc))

    async def _on_generate(self, identity: bytes, fd: int, req: cp.GenerateRequest) -> None:
        arrival = time.time()
        if req.request_id in self.in_flight:
            raise cp.ProtocolError(f"request id {req.request_id!r} is already in flight", req.request_id)
        history = self._sessions.get(req.request_id)
        state = RequestState(
            request_id=req.request_id,
            scheduler_id=str(next(self._scheduler_ids)),
            identity=identity,
            fd=fd,
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
        limits, and when its tokenization started and ended (ns). Touches no mutable state of
        the frontend, so it runs on the loop or on a pool thread."""
        start = profiling.now_ns()
        try:
            prompt_ids = self._encode_input(req, continuing=history is not None, release_gil=release_gil)
        except cp.ProtocolError:
            raise
        except Exception as exc:  # a template error is the client's input, not a server crash
            raise cp.ProtocolError(f"cannot tokenize input: {exc}", req.request_id) from None
        end = profiling.now_ns()
        text_input = req.token_ids is None  # the tokenizer's ids are below its vocabulary
        if history is not None:
            prompt_ids = history + prompt_ids
        self._check_lengths(req, prompt_ids, check_vocab=not text_input or self._tokenizer_exceeds_model)
        return prompt_ids, start, end

    def _admit(
        self, state: RequestState, req: cp.GenerateRequest, history: list[int] | None, prompt_ids: list[int]
    ) -> None:
        """Complete ``state`` (in flight already) with its prompt and send it to the scheduler
        under its scheduler id; from then on the scheduler's outputs find it in :attr:`requests`.

        Synchronous: an abort handled later is queued after the AddRequest."""
        if history is not None:
            self._sessions.pop(req.request_id, None)  # back (extended) when this turn finishes
        state.prompt_ids = prompt_ids
        state.prompt_len = len(prompt_ids)
        state.history_len = len(history) if history is not None else 0
        state.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        state.pending = False
        self.requests[state.scheduler_id] = state
        log.debug("request %r is %s at the scheduler", state.request_id, state.scheduler_id)
        self._send_scheduler(AddRequest(state.scheduler_id, prompt_ids, req.sampling, state.arrival_time, req.priority))

    def _encode_input(self, req: cp.GenerateRequest, continuing: bool, release_gil: bool = False) -> list[int]:
        """The request's input as token ids. A continuation's input follows earlier tokens, so
        no BOS is added to text, and a chat template's leading BOS is dropped."""
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt, add_special_tokens=not continuing, release_gil=release_gil)
        if req.messages is not None:
            ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, release_gil=release_gil)
            bos = self.tokenizer.bos_token_id
            if continuing and ids and bos is not None and ids[0] == bos:
                ids = ids[1:]
            return ids
        return list(req.token_ids)

    def _remember(self, state: RequestState, reason: str) -> None:
        """Keep a finished request's context for a continuation (or, if this turn failed, the
        context it continued)."""
        if reason == FinishReason.ERROR:
            context = state.prompt_ids[: state.history_len] if state.history_len else None
        else:
            context = state.prompt_ids + state.token_ids
        if not context:
            return
        sessions = self._sessions
        sessions[state.request_id] = context
        sessions.move_to_end(state.request_id)
        while len(sessions) > self.config.max_sessions:
            sessions.popitem(last=False)

    def _check_lengths(self, req: cp.GenerateRequest, prompt_ids: list[int], check_vocab: bool = True) -> None:
        max_len = self.config.max_model_len
        vocab = self.config.vocab_size
        if not prompt_ids:
            raise cp.ProtocolError("prompt tokenizes to zero tokens", req.request_id)
        if check_vocab and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):  # min/max: C speed on long prompts
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise cp.ProtocolError(f"token id {bad} is outside the vocabulary [0, {vocab})", req.request_id)
        bad = next((t for t in req.sampling.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise cp.ProtocolError(f"stop token id {bad} is outside the vocabulary [0, {vocab})", req.request_id)
        if len(prompt_ids) >= max_len:
            raise cp.ProtocolError(
                f"prompt has {len(prompt_ids)} tokens; the model's limit is {max_len} including output",
                req.request_id,
            )
        if len(prompt_ids) + req.sampling.max_tokens > max_len:
            raise cp.ProtocolError(
                f"max_tokens={req.sampling.max_tokens} with a {len(prompt_ids)}-token prompt exceeds "
                f"the model length {max_len}; at most {max_len - len(prompt_ids)} new tokens fit",
                req.request_id,
            )

    async def _on_abort(self, request_id: str) -> None:
        state = self.in_flight.get(request_id)
        if state is None:
            return  # already finished (its final is on the way) or never existed: aborts are idempotent
        self._untrack(state)
        if not state.pending:  # a pending one never reached the scheduler
            self._abort_at_scheduler([state.scheduler_id])
        self._finish(state, FinishReason.ABORT)

    def _drop(self, states: list[RequestState]) -> None:
        """Untrack the requests of a client that is gone (no final) and abort those the scheduler has."""
        for state in states:
            self._untrack(state)
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
        """Steps' outputs, oldest first: for each tracked stream, detokenize its new tokens and
        send one delta (or the last delta and the final). Synchronous from first to last stream."""
        start = profiling.now_ns()
        requests = self.requests
        outputs = batch[0].outputs if len(batch) == 1 else _merge(batch)
        num_tokens = 0
        for out in outputs:
            num_tokens += len(out.new_token_ids)
            state = requests.get(out.request_id)
            if state is None:
                continue  # finalized here already (abort, disconnect, stop string): its late outputs
            if out.scheduled_time is not None:
                state.scheduled_time = out.scheduled_time
                state.cached_tokens = out.num_cached_tokens
            if out.first_token_time is not None:
                state.first_token_time = out.first_token_time
            self._on_tokens(state, out.new_token_ids, out.finish_reason, out.error)
        if len(batch) == 1:  # plain next tokens, one per stream: the hot path
            msg = batch[0]
            num_tokens += len(msg.token_ids)
            self._on_next_tokens(msg.request_ids, msg.token_ids)
        self._c_tokens.add(num_tokens)
        self._t_outputs.record(start, arg=len(outputs) + (len(batch[0].request_ids) if len(batch) == 1 else 0))
        if len(batch) > 1:
            self._s_merged.add(len(batch))

    async def _on_scheduler_message(self, msg) -> None:
        """A scheduler message other than TokenOutputs."""
        if isinstance(msg, ProfileReport):
            await self._reply_profile(msg.query_id, msg.profiles)
        elif isinstance(msg, SchedulerStats):
            identity = self._stats_waiters.pop(msg.query_id, None)
            if identity is not None:
                reply = {k: v for k, v in vars(msg).items() if k not in ("query_id", "iteration_fields", "recent_iterations")}
                reply["iterations"] = [dict(zip(msg.iteration_fields, row)) for row in msg.recent_iterations]
                reply.update(type=cp.STATS_REPLY, v=cp.CLIENT_PROTOCOL_VERSION, in_flight=len(self.in_flight))
                await self._send_client(identity, reply)

    def _on_next_tokens(self, request_ids: list[str], token_ids: list[int]) -> None:
        """The streaming hot path: one plain next token for each of these requests (a step's
        columns), each handled as :meth:`_on_tokens` would, in the order given.

        Two passes: first every stream's text and delta bytes, then the sends, back to back
        (measured: about 10 % less CPU per token than sending each delta as soon as it is
        made, presumably because ZeroMQ's I/O thread, busy with the burst, needs waking less
        often; the first stream's delta leaves after the first pass, ~1-2 ms at 1,000 streams).
        A request that a stop string ends gets its last delta and final in the second pass, in
        its place among the others. Cheaper per token than :meth:`_on_tokens` besides: the
        detokenizer's fast paths, the stop-string scan only for requests that have stop
        strings, the delta's bytes put together from the request's head and a per-token tail,
        the backend's send, and the per-token timers and inter-token latency taken for one
        stream in :data:`PROFILE_SAMPLE_EVERY` (its inter-token latency measured from the start
        of this call, as every stream's last output time is)."""
        get = self.requests.get
        tails = self._delta_tails
        pack = self._packer.pack
        countdown = self._sample_countdown
        now = profiling.now_ns()
        out: list = []  # (identity, delta bytes), or (None, state, text, token) for a stop string's finish
        for request_id, token in zip(request_ids, token_ids):
            state = get(request_id)
            if state is None:
                continue  # finalized here already (abort, disconnect, stop string): its late outputs
            countdown -= 1
            timed = countdown == 0
            if timed:
                countdown = PROFILE_SAMPLE_EVERY
                t0 = profiling.now_ns()
                if state.last_output_ns:
                    self._s_itl.add((now - state.last_output_ns) / 1e6, now)
            state.last_output_ns = now
            state.token_ids.append(token)
            text = state.detokenizer.push_one(token)
            if state.has_stop:
                text, stopped = state.stop.feed(text)
                if stopped:
                    state.text.append(text)
                    self._untrack(state)
                    out.append((None, state, text, token))
                    continue
            state.text.append(text)
            if timed:
                self._t_detokenize.record(t0)
            if not state.stream:
                continue
            tail = tails.get(token)
            if tail is None or tail[0] != text:
                tail = tails[token] = (text, pack(text) + _DELTA_IDS_KEY + pack([token]))
                if len(tails) > DELTA_TAILS_MAX:
                    _drop_older_half(tails)
            out.append((state.identity, state.delta_head + tail[1]))
        self._sample_countdown = countdown

        send = _zmq_send
        raw = self._clients_raw
        sndmore = zmq.SNDMORE
        start = profiling.now_ns()
        for item in out:
            identity = item[0]
            if identity is None:
                _, state, text, token = item
                self._abort_at_scheduler([state.scheduler_id])
                self._finish(state, FinishReason.STOP, delta=text, delta_ids=[token])
                continue
            try:
                send(raw, identity, sndmore)  # a gone client fails here, before any frame is queued
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                self._client_gone(identity)
                continue
            send(raw, item[1])
        if out:  # one sample: the mean send of the burst
            end = profiling.now_ns()
            self._t_send.record(end - (end - start) // len(out), end)

    def _on_tokens(
        self, state: RequestState, new_token_ids: list[int], finish_reason: str | None = None, error: str | None = None
    ) -> None:
        """One step's output of a tracked, admitted request: detokenize, stop strings, then a
        delta, or the last delta and the final. Synchronous: one step's outputs for every
        stream are handled without yielding to the loop."""
        emit, stopped = "", False
        if new_token_ids:
            start = profiling.now_ns()
            if state.last_output_ns:
                self._s_itl.add((start - state.last_output_ns) / 1e6, start)
            state.last_output_ns = start
            if len(new_token_ids) > 1 and state.stop.active:  # steps merged: stop at the very token
                new_token_ids, emit, stopped = _feed_each(state, new_token_ids)
            else:
                state.token_ids.extend(new_token_ids)
                emit, stopped = state.stop.feed(state.detokenizer.push(new_token_ids))
            self._t_detokenize.record(start)
        if stopped:
            state.text.append(emit)
            self._untrack(state)
            if finish_reason is None:
                self._abort_at_scheduler([state.scheduler_id])
            self._finish(state, FinishReason.STOP, delta=emit, delta_ids=new_token_ids)
            return
        if finish_reason is not None:
            tail, stopped = state.stop.feed(state.detokenizer.flush())
            emit += tail if stopped else tail + state.stop.flush()
            state.text.append(emit)
            self._untrack(state)
            reason = FinishReason.STOP if state.stop.stopped else finish_reason
            self._finish(state, reason, delta=emit, delta_ids=new_token_ids, error=error)
            return
        state.text.append(emit)
        if state.stream and (emit or new_token_ids):
            self._send_delta(state, emit, new_token_ids)

    def _send_delta(self, state: RequestState, text: str, token_ids: list[int]) -> None:
        """``{type: delta, v, request_id, text, token_ids}``, packed from the request's head."""
        pack = self._packer.pack
        self._push_bytes(state.identity, state.delta_head + pack(text) + _DELTA_IDS_KEY + pack(token_ids))

    def _finish(
        self,
        state: RequestState,
        reason: str,
        *,
        delta: str = "",
        delta_ids: list[int] | None = None,
        error: str | None = None,
    ) -> None:
        """Send a streamed request's last delta (if any), then the final; the caller untracked it.

        Raw sends: only from the handlers :meth:`run` calls (see :meth:`_push_client`)."""
        now = time.time()
        if state.stream and (delta or delta_ids):
            self._send_delta(state, delta, delta_ids or [])
        timing = {
            "queue_time": _since(state.arrival_time, state.scheduled_time),
            "ttft": _since(state.arrival_time, state.first_token_time),
            "total": now - state.arrival_time,
        }
        self._record_request(timing, len(state.token_ids))
        self._remember(state, reason)
        self._push_client(
            state.identity,
            {
                "type": cp.FINAL,
                "v": 1,
                "request_id": state.request_id,
                "text": "".join(state.text),
                "token_ids": state.token_ids,
                "finish_reason": reason,
                "error": error,
                "usage": {
                    "prompt_tokens": state.prompt_len,
                    "completion_tokens": len(state.token_ids),
                    "cached_tokens": state.cached_tokens,
                },
                "timing": timing,
            },
        )

    def _record_request(self, timing: dict[str, float | None], num_tokens: int) -> None:
        """Per-request latencies (ms): queue, time to first token, time per output token, end to end."""
        self._c_finished.add()
        queue, ttft, total = timing["queue_time"], timing["ttft"], timing["total"]
        if queue is not None:
            self._s_queue.add(queue * 1e3)
        if ttft is not None:
            self._s_ttft.add(ttft * 1e3)
            if num_tokens > 1 and total is not None:
                self._s_tpot.add((total - ttft) * 1e3 / (num_tokens - 1))
        if total is not None:
            self._s_e2e.add(total * 1e3)

    # ------------------------------------------------------------------ profile

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
        await self._send_client(
            identity,
            {
                "type": cp.PROFILE_REPLY,
                "v": cp.CLIENT_PROTOCOL_VERSION,
                "clock": profiling.CLOCK_NAME,
                "window_s": cmd.window_s,
                "processes": [profiling.profile_to_map(p) for p in (own, *others)],
                "error": error,
            },
        )

    async def fail_all(self, reason: str) -> None:
        """Give every in-flight request an error (a peer process died or we are shutting down)."""
        states = list(self.in_flight.values())
        self.in_flight.clear()
        self.requests.clear()
        for state in states:
            self._finish(state, FinishReason.ERROR, error=reason)

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
        if request_id is None:
            reply = {"type": cp.ERROR, "v": 1, "request_id": None, "message": message}
        else:
            reply = {
                "type": cp.FINAL,
                "v": 1,
                "request_id": request_id,
                "text": "",
                "token_ids": [],
                "finish_reason": FinishReason.ERROR,
                "error": message,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0},
                "timing": {"queue_time": None, "ttft": None, "total": 0.0},
            }
        await self._send_client(identity, reply)

    def _push_client(self, identity: bytes, obj: dict) -> None:
        """Send to one client now on the raw socket: the streaming hot path. Only from the
        handlers :meth:`run` calls (anywhere else: :meth:`_send_client`)."""
        self._push_bytes(identity, self._packer.pack(obj))

    def _push_bytes(self, identity: bytes, payload: bytes) -> None:
        """:meth:`_push_client` for a message packed already."""
        start = profiling.now_ns()
        raw = self._clients_raw
        try:
            _zmq_send(raw, identity, zmq.SNDMORE)  # a gone client fails here, before any frame is queued
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._client_gone(identity)
            return
        _zmq_send(raw, payload)
        self._t_send.record(start)

    async def _send_client(self, identity: bytes, obj: dict) -> None:
        """Send to one client through the asyncio socket: safe from tasks and timers too."""
        start = profiling.now_ns()
        try:
            await self.clients.send_multipart([identity, cp.pack(obj)], copy=False)
            self._t_send.record(start)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._client_gone(identity)

    def _client_gone(self, identity: bytes) -> None:
        """A send found the client gone: abort its in-flight requests."""
        victims = [s for s in self.in_flight.values() if s.identity == identity]
        if victims:
            log.info("client gone; aborting %d request(s)", len(victims))
            self._drop(victims)


def _drop_older_half(memo: dict) -> None:
    """Drop the older half of a memo's entries (by insertion), in place: what a memo does past its
    cap. Amortized over the misses that filled it (~1 ms for 32768 entries, once per 16384
    misses), and unlike dropping one entry per miss it needs no ordered structure (an
    OrderedDict costs ~50 more bytes an entry) nor a scan over a plain dict's deleted slots."""
    for key in list(itertools.islice(memo, len(memo) // 2)):
        del memo[key]


def _merge(batch: list[TokenOutputs]) -> list[RequestOutput]:
    """Several steps' outputs as one list with one RequestOutput per request: its tokens in
    step order, its first timing fields, and its finish (nothing follows a finish)."""
    merged: dict[str, RequestOutput] = {}
    for msg in batch:
        for out in msg.outputs:
            acc = merged.get(out.request_id)
            if acc is None:
                merged[out.request_id] = RequestOutput(
                    out.request_id,
                    list(out.new_token_ids),
                    out.finish_reason,
                    out.error,
                    out.scheduled_time,
                    out.first_token_time,
                    out.num_cached_tokens,
                )
            elif acc.finish_reason is None:
                acc.new_token_ids.extend(out.new_token_ids)
                acc.finish_reason, acc.error = out.finish_reason, out.error
                if acc.scheduled_time is None and out.scheduled_time is not None:
                    acc.scheduled_time, acc.num_cached_tokens = out.scheduled_time, out.num_cached_tokens
                if acc.first_token_time is None:
                    acc.first_token_time = out.first_token_time
        for request_id, token in zip(msg.request_ids, msg.token_ids):
            acc = merged.get(request_id)
            if acc is None:
                merged[request_id] = RequestOutput(request_id, [token])
            elif acc.finish_reason is None:
                acc.new_token_ids.append(token)
    return list(merged.values())


def _feed_each(state: RequestState, token_ids: list[int]) -> tuple[list[int], str, bool]:
    """Feed merged tokens one at a time, up to the one that completes a stop string, as if
    they had come step by step: the tokens taken, the text released, and whether it stopped."""
    parts: list[str] = []
    for i, token in enumerate(token_ids):
        state.token_ids.append(token)
        emit, stopped = state.stop.feed(state.detokenizer.push([token]))
        parts.append(emit)
        if stopped:
            return token_ids[: i + 1], "".join(parts), True
    return token_ids, "".join(parts), False


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else max(0.0, end - start)


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
