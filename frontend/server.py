"""The frontend process: the client socket, tokenization and streamed detokenization.

One asyncio loop (uvloop) owns every socket of this process and serves them from
a single poller, in a fixed order per wake-up: disconnect events first, then the
control line, then client messages, then scheduler outputs. Handling a client's
disconnect before any message that arrived after it keeps the fd -> client map
honest when the kernel reuses a file descriptor.

Invariants:
- Every request that reached :attr:`Frontend.requests` gets exactly one ``final``
  message (or its client is gone), and leaves the table when it does.
- A request finalized here for any reason other than a scheduler-reported finish
  (client abort, disconnect, stop string) is also aborted at the scheduler, so
  its KV blocks are freed at the next iteration.
- This process never imports torch.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from conveyor.common import client_protocol as cp
from conveyor.common import codec, transport
from conveyor.common.messages import (
    AbortRequests,
    AddRequest,
    FinishReason,
    RequestOutput,
    SchedulerStats,
    Shutdown,
    StatsQuery,
    TokenOutputs,
)
from conveyor.common.transport import ServerAddresses
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.stop import StopStringMatcher
from conveyor.frontend.tokenizer import Tokenizer

log = logging.getLogger("conveyor.frontend")


@dataclass(frozen=True)
class FrontendConfig:
    model_dir: str
    addresses: ServerAddresses
    max_model_len: int
    vocab_size: int  # rows of the model's embedding: token ids must be below it


@dataclass
class RequestState:
    """What the frontend tracks for one in-flight request."""

    request_id: str
    identity: bytes
    fd: int
    stream: bool
    prompt_len: int
    arrival_time: float
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    scheduled_time: float | None = None
    first_token_time: float | None = None


class Frontend:
    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._identities_by_fd: dict[int, set[bytes]] = {}
        self._stats_waiters: dict[str, bytes] = {}
        self._running = True

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

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
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
                await self._drain(self.from_scheduler, self._on_scheduler_message)

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
        for sock in (self.clients, self.monitor, self.to_scheduler, self.from_scheduler, self.control):
            sock.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ client side

    async def _on_monitor_event(self, frames) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        gone = self._identities_by_fd.pop(event["value"], set())
        victims = [s.request_id for s in self.requests.values() if s.identity in gone]
        if victims:
            log.info("client disconnected; aborting %d request(s)", len(victims))
            for rid in victims:
                self.requests.pop(rid)
            await self._abort_at_scheduler(victims)

    async def _on_client_frames(self, frames) -> None:
        if len(frames) != 2:
            return  # DEALER clients send exactly one frame; anything else has no reply path
        identity = frames[0].bytes
        payload = frames[1]
        fd = payload.get(zmq.SRCFD)
        self._identities_by_fd.setdefault(fd, set()).add(identity)
        try:
            cmd = cp.parse_client_message(cp.unpack_map(payload.bytes))
            if isinstance(cmd, cp.GenerateRequest):
                await self._on_generate(identity, fd, cmd)
            elif isinstance(cmd, cp.AbortCommand):
                await self._on_abort(cmd.request_id)
            else:
                query_id = uuid.uuid4().hex
                self._stats_waiters[query_id] = identity
                await self._send_scheduler(StatsQuery(query_id))
        except cp.ProtocolError as exc:
            await self._reply_error(identity, exc.request_id, str(exc))

    async def _on_generate(self, identity: bytes, fd: int, req: cp.GenerateRequest) -> None:
        arrival = time.time()
        if req.request_id in self.requests:
            raise cp.ProtocolError(f"request id {req.request_id!r} is already in flight", req.request_id)
        try:
            if req.prompt is not None:
                prompt_ids = self.tokenizer.encode(req.prompt)
            elif req.messages is not None:
                prompt_ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
            else:
                prompt_ids = req.token_ids
        except cp.ProtocolError:
            raise
        except Exception as exc:  # a template error is the client's input, not a server crash
            raise cp.ProtocolError(f"cannot tokenize input: {exc}", req.request_id) from None
        self._check_lengths(req, prompt_ids)
        state = RequestState(
            request_id=req.request_id,
            identity=identity,
            fd=fd,
            stream=req.stream,
            prompt_len=len(prompt_ids),
            arrival_time=arrival,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            stop=StopStringMatcher(req.stop),
        )
        self.requests[req.request_id] = state
        await self._send_scheduler(AddRequest(req.request_id, prompt_ids, req.sampling, arrival))

    def _check_lengths(self, req: cp.GenerateRequest, prompt_ids: list[int]) -> None:
        max_len = self.config.max_model_len
        vocab = self.config.vocab_size
        if not prompt_ids:
            raise cp.ProtocolError("prompt tokenizes to zero tokens", req.request_id)
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
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
        state = self.requests.pop(request_id, None)
        if state is None:
            return  # already finished (its final is on the way) or never existed: aborts are idempotent
        await self._abort_at_scheduler([request_id])
        await self._finish(state, FinishReason.ABORT)

    # ------------------------------------------------------------------ scheduler side

    async def _on_scheduler_message(self, frame) -> None:
        try:
            msg = codec.decode(frame.buffer)
        except codec.DecodeError as exc:
            log.error("dropping malformed message from scheduler: %s", exc)
            return
        if isinstance(msg, TokenOutputs):
            for out in msg.outputs:
                await self._on_output(out)
        elif isinstance(msg, SchedulerStats):
            identity = self._stats_waiters.pop(msg.query_id, None)
            if identity is not None:
                reply = {k: v for k, v in vars(msg).items() if k != "query_id"}
                reply.update(type=cp.STATS_REPLY, v=cp.CLIENT_PROTOCOL_VERSION, in_flight=len(self.requests))
                await self._send_client(identity, reply)

    async def _on_output(self, out: RequestOutput) -> None:
        state = self.requests.get(out.request_id)
        if state is None:
            return  # finalized here already (abort, disconnect, stop string)
        if out.scheduled_time is not None:
            state.scheduled_time = out.scheduled_time
        if out.first_token_time is not None:
            state.first_token_time = out.first_token_time
        emit, stopped = "", False
        if out.new_token_ids:
            state.token_ids.extend(out.new_token_ids)
            emit, stopped = state.stop.feed(state.detokenizer.push(out.new_token_ids))
        if stopped:
            state.text.append(emit)
            del self.requests[out.request_id]
            if out.finish_reason is None:
                await self._abort_at_scheduler([out.request_id])
            await self._finish(state, FinishReason.STOP, delta=emit, delta_ids=out.new_token_ids)
            return
        if out.finish_reason is not None:
            tail, stopped = state.stop.feed(state.detokenizer.flush())
            emit += tail if stopped else tail + state.stop.flush()
            state.text.append(emit)
            del self.requests[out.request_id]
            reason = FinishReason.STOP if state.stop.stopped else out.finish_reason
            await self._finish(state, reason, delta=emit, delta_ids=out.new_token_ids, error=out.error)
            return
        state.text.append(emit)
        if state.stream and (emit or out.new_token_ids):
            await self._send_delta(state, emit, out.new_token_ids)

    async def _send_delta(self, state: RequestState, text: str, token_ids: list[int]) -> None:
        await self._send_client(
            state.identity,
            {"type": cp.DELTA, "v": 1, "request_id": state.request_id, "text": text, "token_ids": token_ids},
        )

    async def _finish(
        self,
        state: RequestState,
        reason: str,
        *,
        delta: str = "",
        delta_ids: list[int] | None = None,
        error: str | None = None,
    ) -> None:
        """Send a streamed request's last delta (if any), then the final; the caller untracked it."""
        now = time.time()
        if state.stream and (delta or delta_ids):
            await self._send_delta(state, delta, delta_ids or [])
        timing = {
            "queue_time": _since(state.arrival_time, state.scheduled_time),
            "ttft": _since(state.arrival_time, state.first_token_time),
            "total": now - state.arrival_time,
        }
        await self._send_client(
            state.identity,
            {
                "type": cp.FINAL,
                "v": 1,
                "request_id": state.request_id,
                "text": "".join(state.text),
                "token_ids": state.token_ids,
                "finish_reason": reason,
                "error": error,
                "usage": {"prompt_tokens": state.prompt_len, "completion_tokens": len(state.token_ids)},
                "timing": timing,
            },
        )

    async def fail_all(self, reason: str) -> None:
        """Give every in-flight request an error (a peer process died or we are shutting down)."""
        states = list(self.requests.values())
        self.requests.clear()
        for state in states:
            await self._finish(state, FinishReason.ERROR, error=reason)

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

    async def _abort_at_scheduler(self, request_ids: list[str]) -> None:
        await self._send_scheduler(AbortRequests(request_ids))

    async def _send_scheduler(self, msg) -> None:
        await self.to_scheduler.send(codec.encode(msg), copy=False)

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
                "usage": {"prompt_tokens": 0, "completion_tokens": 0},
                "timing": {"queue_time": None, "ttft": None, "total": 0.0},
            }
        await self._send_client(identity, reply)

    async def _send_client(self, identity: bytes, obj: dict) -> None:
        """Send to one client; a client that is gone has its in-flight requests aborted."""
        try:
            await self.clients.send_multipart([identity, cp.pack(obj)], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            victims = [s.request_id for s in self.requests.values() if s.identity == identity]
            for rid in victims:
                self.requests.pop(rid)
            if victims:
                log.info("client gone; aborting %d request(s)", len(victims))
                await self._abort_at_scheduler(victims)


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else max(0.0, end - start)
