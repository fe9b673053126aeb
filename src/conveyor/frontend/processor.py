"""The one request processor of the frontend process and ``conveyor.Engine``: a generate
request's checks before tokenizing, its prompt, its ``n`` > 1 sequences and the objects that
turn each sequence's tokens into text and log-probabilities. Both callers go through it, so a
request is read, refused and answered the same way by either (docs/architecture.md,
"One request processor"). Touches no mutable state: :meth:`RequestProcessor.prompt` runs on a
tokenizer pool thread too."""

from __future__ import annotations

from typing import NamedTuple

from conveyor import profiling
from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.inputs import check_input_chars, context_ids, encode_input, input_chars
from conveyor.frontend.logprobs import LogprobsLog
from conveyor.frontend.stop import StopStringMatcher
from conveyor.frontend.tokenizer import Tokenizer
from conveyor.ipc.messages import sequence_id
from conveyor.protocol import requests as client_requests
from conveyor.protocol import sampling_fields, wire


class Streams(NamedTuple):
    """What turns one output's tokens into its text and log-probabilities: its detokenizer,
    its stop strings and its output log (None: not asked for, or an ``n`` > 1 request's own,
    whose sequences hold theirs)."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    logprobs: LogprobsLog | None


class Prepared(NamedTuple):
    """A tokenized request: its whole context, and when its tokenization started and ended (ns)."""

    prompt_ids: list[int]
    start_ns: int
    end_ns: int


class RequestProcessor:
    """A generate request from its parsed fields to what its outputs are made with.

    ``vocab_size`` and ``max_model_len`` are the model's; ``max_logprobs`` the server's bound
    on ``logprobs`` / ``prompt_logprobs``."""

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int, max_logprobs: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs

    def check(self, req: client_requests.GenerateRequest, history_len: int) -> int:
        """Refuse (ProtocolError) what can be refused before tokenizing: log-probabilities
        beyond the server's bound, an input too long for the model after ``history_len``
        tokens of earlier turns. Returns the input's size in characters (where it is tokenized
        depends on it)."""
        problem = sampling_fields.logprobs_problem(req.sampling, self.max_logprobs)
        if problem is not None:
            raise wire.ProtocolError(problem, req.request_id)
        chars = input_chars(req)
        check_input_chars(req, chars, history_len, self.max_model_len, self.tokenizer.max_chars_per_token)
        return chars

    def prompt(
        self, req: client_requests.GenerateRequest, history: list[int] | None, release_gil: bool = False
    ) -> Prepared:
        """The whole context to run (earlier turns + this input), checked against the model
        (:func:`~conveyor.frontend.inputs.context_ids`; a ``fill_context`` request's
        ``max_tokens`` is set here)."""
        start = profiling.now_ns()
        input_ids = encode_input(self.tokenizer, req, continuing=history is not None, release_gil=release_gil)
        end = profiling.now_ns()
        prompt_ids = context_ids(
            req,
            history,
            input_ids,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            tokenizer_vocab_size=self.tokenizer.vocab_size,
        )
        return Prepared(prompt_ids, start, end)

    def streams(
        self, req: client_requests.GenerateRequest, prompt_ids: list[int], *, sequence: bool = False
    ) -> Streams:
        """A request's own streams (``sequence`` False) or one of its ``n`` > 1 sequences'. An
        ``n`` > 1 request keeps no output log of its own: each sequence has one."""
        k = req.sampling.logprobs
        own = k is not None and (sequence or req.sampling.n == 1)
        return Streams(
            IncrementalDetokenizer(self.tokenizer, prompt_ids, req.skip_special_tokens),
            StopStringMatcher.for_request(req),
            LogprobsLog(k, len(prompt_ids), self.tokenizer) if own else None,
        )

    def prompt_log(self, req: client_requests.GenerateRequest) -> LogprobsLog | None:
        """The log of the prompt's log-probabilities, where asked (one per request, shared by its sequences)."""
        k = req.sampling.prompt_logprobs
        return None if k is None else LogprobsLog(k, 1, self.tokenizer)

    def fork(
        self, req: client_requests.GenerateRequest, prompt_ids: list[int], scheduler_id: str
    ) -> list[tuple[str, Streams]]:
        """An ``n`` > 1 request's sequences, in index order: each one's id at the scheduler
        (``{scheduler_id}/{i}``) and its streams; none for ``n`` = 1."""
        n = req.sampling.n
        if n <= 1:
            return []
        return [(sequence_id(scheduler_id, i), self.streams(req, prompt_ids, sequence=True)) for i in range(n)]
