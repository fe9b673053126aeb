"""The frontend's client intake: each client message parsed (:mod:`conveyor.protocol.requests`)
and answered, or turned into a request: a ``generate`` checked, tokenized (on the loop or a
pool) and admitted to a scheduler through the request processor (:mod:`conveyor.frontend.processor`).
The rules it keeps are the frontend's (docs/architecture.md, "The frontend's rules")."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from conveyor import profiling
from conveyor.frontend.connections import ClientConnections
from conveyor.frontend.constraints import ConstraintCompiler
from conveyor.frontend.liveness import SchedulerWatch
from conveyor.frontend.output import OutputPath
from conveyor.frontend.processor import RequestProcessor
from conveyor.frontend.relays import Relays
from conveyor.frontend.replicas import ReplicaSet
from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.sending import ClientSender
from conveyor.frontend.sessions import Sessions
from conveyor.frontend.shares import ClientShares
from conveyor.frontend.stop import StopStringMatcher
from conveyor.frontend.token_service import TokenService
from conveyor.ipc.messages import AddRequest, FinishReason
from conveyor.protocol import replies, wire
from conveyor.protocol import requests as client_requests
from conveyor.protocol.rl_commands import EngineCommand
from conveyor.protocol.token_commands import DetokenizeCommand, TokenizeCommand
from conveyor.runtime.config import FrontendConfig

log = logging.getLogger("conveyor.frontend")

# Inputs of at least this many characters are tokenized on the one thread of the large-input
# pool (~30 ms of tokenizing and more), so they never hold up the ordinary pool's inputs.
LARGE_INPUT_CHARS = 64 * 1024
# A client frame of at least this many bytes is large: the heap is trimmed after it.
LARGE_FRAME_BYTES = 1 << 20


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


@dataclass
class IntakeParts:
    """What the intake works with: the frontend's tables (``in_flight`` by key, ``requests`` by
    scheduler id), its parts, and its tokenizer pools (None: everything on the loop)."""

    config: FrontendConfig
    processor: RequestProcessor
    constraints: ConstraintCompiler
    in_flight: dict[tuple[bytes, str], RequestState]
    requests: dict[str, RequestState]
    sessions: Sessions
    shares: ClientShares
    replicas: ReplicaSet
    watch: SchedulerWatch
    sender: ClientSender
    output: OutputPath
    metrics: FrontendMetrics
    connections: ClientConnections
    relays: Relays
    tokens: TokenService
    pool: ThreadPoolExecutor | None
    large_pool: ThreadPoolExecutor | None


class ClientIntake:
    """The client intake of the frontend (module docstring). ``drain_disconnects``: handles the
    disconnect events queued so far; ``untrack`` / ``abort``: the frontend's (forget a request,
    abort scheduler ids at their replicas); ``schedule_trim``: trims the heap soon."""

    def __init__(
        self,
        parts: IntakeParts,
        profiler: profiling.Profiler,
        *,
        drain_disconnects: Callable[[], Awaitable[None]],
        untrack: Callable[[RequestState], None],
        abort: Callable[[list[str]], None],
        schedule_trim: Callable[[], None],
    ) -> None:
        p = parts
        self.config, self.processor, self.constraints = p.config, p.processor, p.constraints
        self.in_flight, self.requests, self.sessions, self.shares = p.in_flight, p.requests, p.sessions, p.shares
        self.replicas, self.watch, self.sender, self.output, self.metrics = (
            p.replicas,
            p.watch,
            p.sender,
            p.output,
            p.metrics,
        )
        self.connections, self.relays, self.tokens = p.connections, p.relays, p.tokens
        self._pool, self._large_pool = p.pool, p.large_pool
        self._drain_disconnects = drain_disconnects
        self._untrack = untrack
        self._abort_at_scheduler = abort
        self._schedule_trim = schedule_trim
        self._scheduler_ids = itertools.count(1)  # the next submission's id at the scheduler
        self.tokenizing: set[asyncio.Future] = set()  # pool jobs in flight (kept referenced)
        self._t_tokenize = profiler.timer("tokenize", arg_name="prompt_tokens")
        self._c_client = profiler.counter("client_messages")
        self._c_pooled = profiler.counter("pooled_tokenizations")

    async def on_client_frames(self, frames) -> None:
        # A disconnect queued before this message must be handled first, not after the rest
        # of this drain: its fd may be this message's (closed, then reused by a new client's
        # connection), and the disconnect would then drop the new client's requests too.
        await self._drain_disconnects()
        identity = frames[0].bytes
        payload = frames[-1]
        fd = payload.get(zmq.SRCFD)
        self.connections.note(identity, fd)
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
                await self.relays.profile(identity, cmd)
            elif isinstance(cmd, client_requests.LoraCommand):
                await self.relays.lora(identity, cmd)
            elif isinstance(cmd, EngineCommand):
                await self.relays.engine.relay(identity, cmd)
            elif isinstance(cmd, TokenizeCommand):
                self.tokens.tokenize(identity, cmd)
            elif isinstance(cmd, DetokenizeCommand):
                self.tokens.detokenize(identity, cmd)
            elif isinstance(cmd, client_requests.MetricsCommand):
                await self.sender.send(identity, replies.metrics_reply(**self.metrics.snapshot()))
            else:
                self.relays.stats(identity, cmd.iterations)
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
        hung = self.watch.refusal()
        if hung is not None:
            raise wire.ProtocolError(hung, req.request_id, wire.SERVER_ERROR)
        history = self.sessions.context((key, req.request_id))
        chars = self.processor.check(req, len(history or ()))
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
            lora=req.lora,
        )
        if req.constraint is None and (self._pool is None or chars < self.config.tokenize_inline_chars):
            prompt_ids, start, end = self.processor.prompt(req, history)
            self._t_tokenize.record(start, end, arg=len(prompt_ids) - len(history or ()))
            state.share = self.shares.take(key, fd, max(1, req.sampling.n), req.request_id)
            self.in_flight[state.key] = state
            self._admit(state, req, history, prompt_ids)
            return
        state.pending = True
        state.share = self.shares.take(key, fd, max(1, req.sampling.n), req.request_id)
        self.in_flight[state.key] = state
        self._c_pooled.add()
        large = chars >= LARGE_INPUT_CHARS
        job = asyncio.ensure_future(self._tokenize_in_pool(state, req, history, large))
        self.tokenizing.add(job)
        job.add_done_callback(self.tokenizing.discard)

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
                prompt_ids, start, end = self.processor.prompt(req, history)
            else:
                prompt_ids, start, end = await loop.run_in_executor(pool, self.processor.prompt, req, history, True)
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
            self.shares.give_back(state.client_key, state.share)
            await self._reply_error(state.identity, state.client_key, error)
            return
        self._admit(state, req, history, prompt_ids)

    def _admit(
        self,
        state: RequestState,
        req: client_requests.GenerateRequest,
        history: list[int] | None,
        prompt_ids: list[int],
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
        streams = self.processor.streams(req, prompt_ids)
        state.detokenizer = streams.detokenizer
        sampling = req.sampling
        choices = sampling.n > 1 and sampling.logprobs is not None and not req.ranking_logprobs
        state.set_logs(streams.logprobs, self.processor.prompt_log(req), choices=choices)
        state.keep_best = req.keep_best
        state.return_prompt_ids = req.return_prompt_token_ids
        state.pending = False
        self.requests[state.scheduler_id] = state  # (n > 1: where a refusal of the whole request finds it)
        for i, (seq_id, seq_streams) in enumerate(self.processor.fork(req, prompt_ids, state.scheduler_id)):
            seq = RequestState(
                request_id=state.request_id,
                scheduler_id=seq_id,
                identity=state.identity,
                stream=state.stream,
                prompt_len=state.prompt_len,
                arrival_time=state.arrival_time,
                detokenizer=seq_streams.detokenizer,
                stop=seq_streams.stop,
                client_key=state.client_key,
                fd=state.fd,
                index=i,
                parent=state,
                max_tokens=state.max_tokens,
            )
            seq.set_sequence_logs(seq_streams.logprobs)
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

    async def _reply_error(self, identity: bytes, key: bytes, exc: wire.ProtocolError) -> None:
        """Answer a refused message. A refused ``generate`` whose id could be read ends as that
        request's error ``final``, unless the client has a request in flight under that id (its
        final is still to come: one final per id at a time); a frame that did not decode, or
        that refusal, gets an ``error`` map with the id it carried (None if none was readable)."""
        rid = exc.request_id
        readable = rid is not None or exc.command is not None  # a command carries no id: its type routes the answer
        message = str(exc) if readable else f"{exc} (no request_id could be read from this message)"
        if isinstance(exc, (wire.FrameError, wire.CommandError)) or (rid is not None and (key, rid) in self.in_flight):
            reply = replies.error_map(rid, message, exc.code)
        else:
            reply = replies.error_reply(rid, message, exc.code, command=exc.command)
        await self.sender.send(identity, reply)
