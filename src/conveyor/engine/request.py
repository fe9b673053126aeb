"""One request of the in-process engine, as its caller sees it: tokens, text, its end.

Its text is made the way the server makes a stream's (:mod:`conveyor.frontend.output`):
the same :class:`~conveyor.frontend.detokenizer.IncrementalDetokenizer` and
:class:`~conveyor.frontend.stop.StopStringMatcher`, through the same two functions
(:func:`~conveyor.frontend.output.stream_text` per step, :func:`~conveyor.frontend.output.end_text`
at the end), so ``text`` is at every moment what a streaming client would have been sent,
and at the end what its final says.

Invariants:
- ``text`` never shows what the final text lacks (held-back tails of a possible stop
  string or of an incomplete character come out later, or never).
- Once ``done``, nothing changes but the read marks of :meth:`Request.take_new`.
- ``tokens`` are this turn's output ids; a stop string cuts them at the token that
  completed it, and ``text`` before the stop string.

Parallel sampling: a request added with ``n`` > 1 has ``n`` sequences (:attr:`Request.outputs`,
each a :class:`Request` of its own with its ``index``, its own detokenizer and stop strings,
at the scheduler as ``{id}/{index}``). The request is ``done`` when every sequence is, or when
it ends as a whole (removed, or a sequence failed: the others are then aborted with the same
error); its ``tokens`` and ``text`` are sequence 0's.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from conveyor.frontend.logprobs import Logprob, LogprobsLog
from conveyor.frontend.output import end_text, stream_text
from conveyor.frontend.processor import Streams
from conveyor.ipc.messages import FinishReason, TokenLogprobs


class Owner(Protocol):
    """The engine a request belongs to, as the request sees it (:class:`conveyor.Engine`,
    which imports this module): what :meth:`Request.remove` asks of it."""

    def _remove(self, request: Request) -> None: ...


class TextDelta(NamedTuple):
    """What a request produced since the last :meth:`Request.take_new`."""

    token_ids: list[int]
    text: str


class Request:
    """A request added by :meth:`Engine.add_request`; the engine fills it in as steps run.

    ``request_id`` is the caller's (or a generated) id; adding a request under it once this
    one is done continues it (the engine's docstring). ``prompt_token_ids`` is the whole
    context it ran on, earlier turns included; ``num_cached_tokens`` how many of those the
    prefix cache supplied; ``arrival_time``, ``scheduled_time`` and ``first_token_time`` are
    ``time.time()`` values (None until they happen). ``logprobs`` / ``prompt_logprobs``:
    where asked for, the log-probabilities of its output and prompt tokens
    (:class:`~conveyor.frontend.logprobs.Logprob` entries; the first prompt token's is None).
    ``weight_version``: the engine's :attr:`~conveyor.Engine.weight_version` it ran on (a
    weight update lets requests in flight finish, or aborts them, before it loads).
    """

    weight_version = 0

    def __init__(
        self,
        engine: Owner,
        request_id: str,
        scheduler_id: str,
        prompt_token_ids: list[int],
        history_len: int,
        streams: Streams,
        arrival_time: float,
        prompt_logprobs: LogprobsLog | None = None,
        *,
        index: int = 0,
        parent: Request | None = None,
    ) -> None:
        self.request_id = request_id
        self._detokenizer, self._stop, self._logprobs = streams
        self._prompt_logprobs = prompt_logprobs
        self.index = index  # its sequence's index in its request (0 unless n > 1)
        self.sequences: list[Request] = []  # n > 1: the request's sequences (:attr:`outputs`)
        self._parent = parent
        self._keep_best: int | None = None  # best_of > n: how many of its sequences it returns
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._engine = engine
        self._scheduler_id = scheduler_id
        self._history_len = history_len
        self._tokens: list[int] = []
        self._pieces: list[str] = []
        self._text_len = 0
        self._read_tokens = 0  # take_new's marks
        self._read_chars = 0
        self._embedding: bytes | None = None  # a pooling request's vector, as the scheduler sent it

    def __repr__(self) -> str:
        state = f"done: {self.finish_reason}" if self.done else "running"
        return f"Request({self.request_id!r}, {len(self._tokens)} tokens, {state})"

    # ------------------------------------------------------------------ reading

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[Request]:
        """The request's sequences in index order: itself alone unless it asked for ``n`` > 1."""
        return self.sequences or [self]

    @property
    def tokens(self) -> list[int]:
        """This turn's output token ids so far (a copy; sequence 0's for n > 1)."""
        return list(self.outputs[0]._tokens)

    @property
    def text(self) -> str:
        """This turn's output text so far, as a streaming client has been sent it (sequence 0's for n > 1)."""
        return "".join(self.outputs[0]._pieces)

    @property
    def logprobs(self) -> list[Logprob] | None:
        """One entry per output token so far (None: not asked for; sequence 0's for n > 1;
        with best_of > n and none asked, the sampled tokens' that ranked it)."""
        seq = self.outputs[0]
        return None if seq._logprobs is None else seq._logprobs.entries(seq._tokens)

    @property
    def prompt_logprobs(self) -> list[Logprob | None] | None:
        """One entry per prompt token computed so far, the first None (None: not asked for;
        n > 1: the request's, which each of its sequences shows too)."""
        log = self._prompt_logprobs
        if log is None:
            return None
        return [None, *log.entries(self.prompt_token_ids[1:])]

    @property
    def embedding(self) -> list[float] | None:
        """A pooling request's L2-normalized vector (``pooling`` set; :meth:`Engine.embed`)."""
        data = self._embedding
        return None if data is None else list(struct.unpack(f"<{len(data) // 4}f", data))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def has_available_tokens(self) -> bool:
        """Whether tokens (or text) came since the last :meth:`take_new` (for n > 1: read
        each of :attr:`outputs`)."""
        return len(self._tokens) > self._read_tokens or self._text_len > self._read_chars

    def take_new(self) -> TextDelta:
        """The tokens and text produced since the last call (both empty if none)."""
        ids = self._tokens[self._read_tokens :]
        text = self.text[self._read_chars :] if self._text_len > self._read_chars else ""
        self._read_tokens, self._read_chars = len(self._tokens), self._text_len
        return TextDelta(ids, text)

    def remove(self) -> None:
        """Abort the request if it still runs (its KV blocks are freed now), and forget it:
        its id no longer continues it. Idempotent."""
        self._engine._remove(self)

    # ------------------------------------------------------------------ filled in by the engine

    def _push_prompt_logprobs(self, lp: TokenLogprobs) -> None:
        if self._prompt_logprobs is not None:
            self._prompt_logprobs.add(lp)

    def _push(self, token_ids: Sequence[int], logprobs: TokenLogprobs | None = None) -> bool:
        """Take a step's new tokens (and their log-probabilities, where asked for); True if a
        stop string ended the output with them."""
        text, taken, stopped = stream_text(self._detokenizer, self._stop, token_ids)
        self._tokens += token_ids[:taken] if stopped else token_ids
        if logprobs is not None and self._logprobs is not None:
            self._logprobs.add(logprobs, taken)
        self._add_text(text)
        return stopped

    def _end(self, reason: str, error: str | None, flush: bool) -> str:
        """Mark the request done; ``flush``: release what the detokenizer and the stop
        strings held back (a finish the scheduler reported), as a final does. Returns the
        finish reason: ``stop`` whenever a stop string matched."""
        if flush and not self._stop.stopped:
            self._add_text(end_text(self._detokenizer, self._stop))
        self.finish_reason = FinishReason.STOP if self._stop.stopped else reason
        self.error = error
        return self.finish_reason

    def _add_text(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._text_len += len(text)
