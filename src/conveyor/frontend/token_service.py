"""The frontend's answers to ``tokenize`` and ``detokenize`` (docs/protocol.md): the HTTP
process's ``/tokenize``, ``/detokenize``, ``echo``, ``return_token_ids`` and usage counts come
from here, so that process loads no tokenizer. An input is measured before it is tokenized
(the request processor's bound, as a generate's); a large one is tokenized on the large-input
pool under a deadline, never on the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from conveyor.frontend.inputs import encode_input
from conveyor.frontend.processor import RequestProcessor
from conveyor.frontend.sending import ClientSender
from conveyor.protocol import replies, wire
from conveyor.protocol.token_commands import DetokenizeCommand, TokenizeCommand

log = logging.getLogger("conveyor.frontend")

# A tokenize or detokenize still running after this long is answered with a ``timeout``
# error (its thread finishes in the background; the input bound keeps that finite).
TOKENIZE_DEADLINE_S = 30.0


class TokenService:
    """``tokenize`` / ``detokenize`` for the frontend: what it reads and where it runs.
    ``inline_chars``: inputs shorter than this are tokenized on the loop; ``large_chars``:
    inputs this long go to ``large_pool``; ``trim``: called after a large input."""

    def __init__(
        self,
        processor: RequestProcessor,
        sender: ClientSender,
        pool: ThreadPoolExecutor | None,
        large_pool: ThreadPoolExecutor | None,
        *,
        inline_chars: int,
        large_chars: int,
        trim: Callable[[], None],
    ) -> None:
        self.processor = processor
        self.sender = sender
        self.pool = pool
        self.large_pool = large_pool
        self.inline_chars = inline_chars
        self.large_chars = large_chars
        self.trim = trim
        self._jobs: set[asyncio.Future] = set()  # answers being computed (kept referenced)

    def tokenize(self, identity: bytes, cmd: TokenizeCommand) -> None:
        """Answer ``cmd`` (now, or from a pool thread): the input's ids as a generate would
        have them (no earlier turns), or an ``error`` map."""
        req = cmd.request
        try:
            chars = self.processor.check(req, 0)
        except wire.ProtocolError as exc:
            self._spawn(self._send_error(identity, cmd.request_id, exc))
            return
        continuing = not cmd.add_special_tokens and req.prompt is not None
        work = lambda pooled: encode_input(self.processor.tokenizer, req, continuing, release_gil=pooled)  # noqa: E731
        self._spawn(self._answer(identity, cmd.request_id, chars, work, lambda ids: self._tokens_reply(cmd, ids)))

    def detokenize(self, identity: bytes, cmd: DetokenizeCommand) -> None:
        """Answer ``cmd``: the ids decoded as they are (special tokens kept), or an ``error``
        map naming an id outside the vocabulary."""
        vocab = self.processor.tokenizer.vocab_size
        bad = next((t for t in cmd.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            error = wire.ProtocolError(
                f"token id {bad} is outside the vocabulary [0, {vocab})", cmd.request_id, wire.INVALID_INPUT
            )
            self._spawn(self._send_error(identity, cmd.request_id, error))
            return
        work = lambda pooled: self.processor.tokenizer.decode(cmd.token_ids, False)  # noqa: E731
        rid = cmd.request_id

        def reply(text):
            return {"type": wire.TEXT_REPLY, "v": wire.CLIENT_PROTOCOL_VERSION, "request_id": rid, "text": text}

        self._spawn(self._answer(identity, cmd.request_id, len(cmd.token_ids), work, reply))

    def _tokens_reply(self, cmd: TokenizeCommand, ids: list[int]) -> dict:
        reply = {
            "type": wire.TOKENS_REPLY,
            "v": wire.CLIENT_PROTOCOL_VERSION,
            "request_id": cmd.request_id,
            "token_ids": ids,
            "max_model_len": self.processor.max_model_len,
        }
        if cmd.return_token_strs:
            reply["token_strs"] = self.processor.tokenizer.convert_ids_to_tokens(ids)
        return reply

    async def _answer(
        self, identity: bytes, rid: str, size: int, work: Callable[[bool], object], reply: Callable
    ) -> None:
        """Run ``work`` where ``size`` says (its argument: on a pool thread), then send ``reply`` of its result."""
        large = size >= self.large_chars
        pool = self.large_pool if large else self.pool
        try:
            if pool is None or size < self.inline_chars:
                result = work(False)
            else:
                job = asyncio.get_running_loop().run_in_executor(pool, work, True)
                result = await asyncio.wait_for(job, TOKENIZE_DEADLINE_S)
            message = reply(result)
        except wire.ProtocolError as exc:
            await self._send_error(identity, rid, exc)
            return
        except (asyncio.TimeoutError, TimeoutError):
            await self._send_error(
                identity, rid, wire.ProtocolError(f"not done within {TOKENIZE_DEADLINE_S:g} s", rid, wire.TIMEOUT)
            )
            return
        except Exception as exc:  # a bug, not the client's input: still one answer
            log.exception("tokenize/detokenize %r failed", rid)
            await self._send_error(identity, rid, wire.ProtocolError(f"internal error: {exc}", rid, wire.SERVER_ERROR))
            return
        finally:
            if large:
                self.trim()
        await self.sender.send(identity, message)

    async def _send_error(self, identity: bytes, rid: str, exc: wire.ProtocolError) -> None:
        await self.sender.send(identity, replies.error_map(rid, str(exc), exc.code))

    def _spawn(self, coro) -> None:
        job = asyncio.ensure_future(coro)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
