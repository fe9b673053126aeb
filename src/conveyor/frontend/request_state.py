"""What the frontend tracks for one request, from its ``generate`` to its ``final``."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.logprobs import LogprobsLog
from conveyor.frontend.stop import StopStringMatcher
from conveyor.protocol.replies import delta_head


@dataclass
class RequestState:
    """One in-flight request.

        ``request_id`` is the client's id (every message the client gets carries it);
        ``scheduler_id`` the id this submission has at the scheduler, unique per submission
        (see :class:`conveyor.frontend.server.Frontend`). A state built without one
        (``bench/frontend_step.py`` fills :attr:`Frontend.requests` by hand) is known to the
        scheduler by its client id. ``client_key`` names the client that sent it
        (:func:`conveyor.frontend.intake.client_key`): a request id names a request only within
        its client, so the frontend's tables hold :attr:`key`. ``text`` holds the pieces of text returned so far (stop
        strings cut), ``token_ids`` every output token; the final carries both whole.

    Parallel sampling (``n`` > 1): the request's state (the *parent*: in flight under its key,
    known to the scheduler by its scheduler id until the scheduler took it) has one state per
    sequence in ``sequences``, each with its own detokenizer and stop strings, known to the
    scheduler as ``{scheduler_id}/{index}`` (:func:`~conveyor.ipc.messages.sequence_id`),
    its ``parent`` set and its ``index`` carried by each of its deltas. A sequence's end is
    noted in its ``finish_reason``; the parent's final, with every sequence's choice, goes out
    when the last sequence ended (``ended`` is then set), or at once when the request as a whole
    ends (an abort, an error of the request or of any of its sequences)."""

    request_id: str
    identity: bytes
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
    max_tokens: int = 0  # the max_tokens it runs with (set when admitted; 0 before)
    pending: bool = False  # prompt still tokenizing in the pool: the scheduler has not seen it
    delta_head: bytes = b""  # set from request_id: every delta's bytes up to its text
    has_stop: bool = False  # set from stop: the request has stop strings to look for
    scheduler_id: str = ""  # its id at the scheduler ("" in a hand-built state: request_id)
    client_key: bytes = b""  # its client (b"" in a hand-built state)
    fd: int = -1  # the file descriptor of the connection that sent it: its disconnect drops it
    lora: str | None = None  # the LoRA adapter it runs under (an unload waits for it to end)
    index: int | None = None  # a sequence of an n > 1 request: its index (its deltas carry it)
    parent: RequestState | None = None  # a sequence: the request it belongs to
    sequences: list[RequestState] = field(default_factory=list)  # an n > 1 request: its sequences
    finish_reason: str | None = None  # a sequence: why it ended (None while it runs)
    ended: bool = False  # an n > 1 request: its final is sent
    keep_best: int | None = None  # best_of > n: the n of its sequences returned (the most likely)
    # Where it asked for them (set with its prompt): its output and prompt tokens' log-probabilities.
    # n > 1: each sequence has its own output log; the prompt's is the request's, one log that
    # its sequences share (the leader's prefill fills it; the next delta of any carries what is new).
    logprobs: LogprobsLog | None = None
    prompt_logprobs: LogprobsLog | None = None
    logged: bool = False  # either of them: its deltas and final carry log-probability fields
    choice_logprobs: bool = False  # an n > 1 request: its final's choices carry their logprobs
    return_prompt_ids: bool = False  # its final carries prompt_token_ids (the whole context)
    share: int = 0  # the sequences it counts against its client's share (conveyor.frontend.shares)
    embedding: bytes | None = None  # a pooling request's vector (float32 bytes): its final carries it
    weight_version: int | None = None  # the server's weight version it ran on (from its last output)

    @property
    def key(self) -> tuple[bytes, str]:
        """The request's name in the frontend's tables and sessions: (client, client's id)."""
        return self.client_key, self.request_id

    def set_logs(self, logprobs: LogprobsLog | None, prompt_logprobs: LogprobsLog | None, *, choices: bool) -> None:
        """The logs of the log-probabilities the request asked for (made by the request
        processor, :mod:`conveyor.frontend.processor`). ``choices``: an ``n`` > 1 request's
        final carries each choice's (False with best_of ranking logs the client did not ask for)."""
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs
        self.choice_logprobs = choices
        self.logged = logprobs is not None or prompt_logprobs is not None or self.choice_logprobs

    def set_sequence_logs(self, logprobs: LogprobsLog | None) -> None:
        """A sequence's logs (its parent's set): its own output log, its request's prompt log."""
        parent = self.parent
        assert parent is not None
        self.logprobs = logprobs
        self.prompt_ids, self.prompt_logprobs, self.logged = parent.prompt_ids, parent.prompt_logprobs, parent.logged

    def logprob_fields(self, whole: bool) -> dict:
        """The log-probability fields of its next delta (what is new) or its final (``whole``)."""
        fields = {}
        if self.prompt_logprobs is not None:
            prompt = self.prompt_ids[self.prompt_logprobs.start :]
            if whole:
                fields["prompt_logprobs"] = self.prompt_logprobs.columns(prompt)
            else:
                new = self.prompt_logprobs.take_new(prompt)
                if new is not None:
                    fields["prompt_logprobs"] = new
        if self.logprobs is not None:
            if whole:
                fields["logprobs"] = self.logprobs.columns(self.token_ids)
            else:
                new = self.logprobs.take_new(self.token_ids)
                if new is not None:
                    fields["logprobs"] = new
        return fields

    def __post_init__(self) -> None:
        if not self.scheduler_id:
            self.scheduler_id = self.request_id
        self.delta_head = delta_head(self.request_id, self.index)
        self.has_stop = self.stop.active
