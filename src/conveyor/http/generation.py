"""``/v1/completions`` and ``/v1/chat/completions``: a :class:`GenerationJob` run through the
frontend link, answered whole or as server-sent events.

Each input of the job is one client-protocol request, run by :mod:`conveyor.http.job_runs`
(the one request lifecycle: statuses, disconnects, slow readers); this module writes OpenAI's
answers of it: the body, or the chunks of a stream (a failure after the status as an error
event followed by ``[DONE]``).

Fields beyond the text (:class:`GenerationJob`): ``echo`` starts each choice's text with its
prompt (the string sent, or a token-id prompt decoded), ``return_token_ids`` adds the token
ids, ``continuous_usage_stats`` the usage so far to every chunk, ``logprobs`` the
log-probabilities in OpenAI's shapes (:mod:`conveyor.http.openai_logprobs`; with ``echo``, the
prompt's first, and each streamed chunk's for its own tokens) and ``prompt_logprobs``
vLLM's per-prompt-token list; the prompt's ids these need
come from the HTTP process's tokenizer (:mod:`conveyor.http.tokens`), asked only when a
request needs them. The body's ignored and unknown fields are named in the
``x-conveyor-ignored-fields`` header and the log (:func:`ignored_fields`, which the Messages
API uses too).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from aiohttp import web

from conveyor.client import CompletionResult, StreamDelta
from conveyor.http.errors import ApiError
from conveyor.http.job_runs import checked, generate_all, stream_events
from conveyor.http.link import FrontendLink
from conveyor.http.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from conveyor.http.openai_requests import CHAT, COMPLETION, GenerationJob
from conveyor.http.openai_responses import DONE, ChunkEncoder, completion_body, json_encode, response_id, usage_so_far
from conveyor.http.output_reading import OutputReader, counting_reader
from conveyor.http.request_ids import request_id
from conveyor.http.tokens import Tokens
from conveyor.ipc.messages import FinishReason

log = logging.getLogger("conveyor.http")

IGNORED_FIELDS_HEADER = "x-conveyor-ignored-fields"
# Unknown field names warned about so far (each once), at most this many remembered.
_WARNED: set[str] = set()
MAX_WARNED_FIELDS = 1024


class _Prompts:
    """What a job needs of its prompts: their ids (``return_token_ids``, continuous usage)
    and the texts ``echo`` puts in front (None where not asked)."""

    def __init__(
        self, ids: list[list[int]] | None, echoes: list[str] | None, first_tokens: list[str] | None = None
    ) -> None:
        self.ids = ids
        self.echoes = echoes
        self.first_tokens = first_tokens  # echo with logprobs: each prompt's first token's text (it has no value)


def _needs_prompt_ids(job: GenerationJob) -> bool:
    """Whether the answer shows the prompts' ids (``return_token_ids``, continuous usage,
    prompt log-probabilities, ``echo`` with logprobs)."""
    echo_logprobs = job.echo and job.kind == COMPLETION and job.logprobs is not None
    return job.return_token_ids or job.continuous_usage or job.prompt_logprobs or echo_logprobs


async def _prompts(job: GenerationJob, tokens: Tokens, ids: list[list[int]] | None = None) -> _Prompts:
    """What the answer needs of its prompts. ``ids``: the prompts' ids as the finals carried them
    (``return_prompt_token_ids``); None: a stream's, asked of the frontend before it starts."""
    if ids is None and _needs_prompt_ids(job):
        ids = [await tokens.prompt_ids(inp, job.options) for inp in job.inputs]
    echoes = None
    if job.echo and job.kind == COMPLETION:
        echoes = [inp["prompt"] if "prompt" in inp else await tokens.decode(inp["token_ids"]) for inp in job.inputs]
    first_tokens = None
    if job.echo and job.kind == COMPLETION and job.logprobs is not None:
        first_tokens = [await tokens.decode(p[:1]) for p in ids]  # type: ignore[union-attr]
    return _Prompts(ids, echoes, first_tokens)


def _logprob_fields(
    job: GenerationJob,
    prompts: _Prompts,
    index: int,
    rows: dict | None,
    prompt_rows: dict | None,
    offset: int,
    first: bool,
) -> dict[str, Any]:
    """The log-probability fields of choice ``index`` for output ``rows`` and ``prompt_rows``
    (a whole answer's, or one chunk's: ``first`` for its first, which carries the echoed
    prompt's); ``offset``: the text offset of the first token listed."""
    fields: dict[str, Any] = {}
    if job.logprobs is not None:
        if job.kind == CHAT:
            fields["logprobs"] = chat_logprobs(rows) if rows else None
        elif first and prompts.first_tokens is not None:
            fields["logprobs"] = completion_logprobs(rows, offset, prompt_rows or {}, prompts.first_tokens[index])
        elif rows:
            fields["logprobs"] = completion_logprobs(rows, offset)
    if job.prompt_logprobs and prompt_rows:
        fields["prompt_logprobs"] = prompt_logprobs(prompt_rows, prompts.ids[index])  # type: ignore[index]
    return fields


async def respond(
    request: web.Request,
    link: FrontendLink,
    job: GenerationJob,
    model: str,
    tokens: Tokens,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> web.StreamResponse:
    """The HTTP answer to ``job``; :class:`ApiError` for a failure known before it starts.
    ``tool_parser``: the server's ``--tool-call-parser`` (None: a chat's tools are rendered,
    its output is not parsed for calls unless ``tool_choice`` forced them);
    ``reasoning_parser``: its ``--reasoning-parser`` (a chat's think block as ``reasoning_content``)."""
    await link.require_started()
    rid = response_id(job.kind, request_id(request))
    created = int(time.time())
    headers = ignored_fields(rid, job)
    reader = await counting_reader(job, tool_parser, reasoning_parser, tokens)
    if job.stream:
        prompts = await _prompts(job, tokens)
        enc = ChunkEncoder(job.kind, rid, created, model, job.include_usage)
        encoder = _Encoder(job, enc, prompts, reader, reasoning_parser is not None and job.kind == CHAT)
        return await stream_events(request, link, job, encoder, headers)
    if _needs_prompt_ids(job):  # the finals carry them: the frontend tokenizes each prompt once
        job.options["return_prompt_token_ids"] = True
    results = await generate_all(link, job)
    ids = [r.prompt_token_ids for r in results] if _needs_prompt_ids(job) else None
    prompts = await _prompts(job, tokens, ids)
    prompt_ids = prompts.ids if job.return_token_ids else None
    extras = None
    if job.logprobs is not None or job.prompt_logprobs:
        extras = [
            _logprob_fields(job, prompts, i, c.logprobs, r.prompt_logprobs, 0, True)
            for i, r in enumerate(results)
            for c in r.choices
        ]
    body = completion_body(
        job.kind, rid, created, model, results, echoes=prompts.echoes, prompt_ids=prompt_ids, extras=extras
    )
    if reasoning_parser is not None and job.kind == CHAT:
        counted = reader.reasoning_tokens(results) if reader is not None else 0
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": counted}
    if reader is not None:  # each choice read on its own (n > 1: each sequence wrote its own calls)
        for choice, seq in zip(body["choices"], [seq for r in results for seq in r.choices]):
            reasoning, content, calls = reader.whole(seq.text)
            if reasoning is None and not calls:
                continue
            choice["message"] = message = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
                choice["finish_reason"] = _tool_finish(seq.finish_reason)
    return web.Response(body=json_encode(body), content_type="application/json", headers=headers)


def ignored_fields(rid: str, job: GenerationJob) -> dict[str, str]:
    """The response headers that name the body's ignored fields (none: no header), with a log
    line: an info line per request, and a warning the first time a field name no schema knows
    is seen (:attr:`GenerationJob.unknown`; a typo is worth one look, not one line a request)."""
    if not job.ignored:
        return {}
    log.info("%s: ignored request field(s) with no effect here: %s", rid, ", ".join(job.ignored))
    new = [name for name in job.unknown if name not in _WARNED]
    if new:
        log.warning("unknown request field(s) ignored (--strict-fields refuses them): %s", ", ".join(map(repr, new)))
        if len(_WARNED) < MAX_WARNED_FIELDS:
            _WARNED.update(new)
    return {IGNORED_FIELDS_HEADER: ",".join(job.ignored)}


def _tool_finish(reason: str) -> str:
    """OpenAI's ``tool_calls`` where the output ended by itself with calls; else as it ended."""
    return "tool_calls" if reason == FinishReason.STOP else reason


class _Encoder:
    """Appends each delta's events to ``out``. The plain path (text only) is
    :meth:`ChunkEncoder.text`; a job with ``echo``, ``return_token_ids`` or continuous usage
    builds its chunks as dicts with those fields (:meth:`ChunkEncoder.chunk`). Input ``i``'s
    sequence ``j`` (``StreamDelta.index``) is choice ``i * n + j``; an input's final ends each of
    its choices (its ``finish_reason``), and continuous usage counts the input's tokens."""

    def __init__(
        self,
        job: GenerationJob,
        enc: ChunkEncoder,
        prompts: _Prompts,
        tools: OutputReader | None = None,
        count_reasoning: bool = False,
    ) -> None:
        self.enc, self.out = enc, bytearray()
        self.finals: list[CompletionResult | None] = [None] * len(job.inputs)
        self.n = job.n
        self.started = [False] * (len(job.inputs) * job.n)  # by choice
        self.tools = [tools.stream() for _ in self.started] if tools is not None else None  # by choice
        self.reader = tools
        self.count_reasoning = count_reasoning  # the usage chunk says how many tokens were reasoning
        self.called = [False] * len(self.started)
        self.prompts = prompts
        self.token_ids = job.return_token_ids
        self.continuous = job.continuous_usage
        self.job = job
        self.logged = job.logprobs is not None or job.prompt_logprobs
        self.plain = not (self.token_ids or self.continuous or prompts.echoes is not None or self.logged)
        self.generated = [0] * len(job.inputs)  # by input
        # Text offset of the next token of each choice (completions' logprobs), and each input's
        # prompt columns once a delta brought them (every choice's first chunk echoes them).
        self.offsets = [0] * len(self.started)
        self.prompt_rows: dict[int, dict[str, Any]] = {}

    def start(self) -> None:
        if self.job.kind == CHAT:  # each choice's first chunk: the assistant role
            for choice in range(len(self.started)):
                self.out += self.enc.role(choice)

    def fail(self, error: ApiError) -> None:
        self.out += self.enc.error(error) + DONE

    def end(self) -> None:
        if self.job.include_usage:
            reasoning = None
            if self.count_reasoning:
                reasoning = self.reader.reasoning_tokens(self.finals) if self.reader is not None else 0  # type: ignore[arg-type]
            self.out += self.enc.usage(self.finals, reasoning)  # type: ignore[arg-type]
        self.out += DONE

    def __call__(self, index: int, delta: StreamDelta) -> int:
        """1 when ``delta`` was input ``index``'s final (ApiError if that final is an error)."""
        if self.tools is not None:
            return self._tool_delta(index, delta)
        choice = index * self.n + delta.index
        if self.plain:
            if delta.text:
                self.out += self.enc.text(choice, delta.text)
        elif delta.text or delta.token_ids or not self.started[choice]:
            self.out += self._detailed(index, choice, delta)
        if delta.result is None:
            return 0
        self.finals[index] = result = checked(delta.result)
        for seq in result.choices:
            self.out += self.enc.finish(index * self.n + seq.index, seq.finish_reason, None, self._usage(index))
        return 1

    def _tool_delta(self, index: int, delta: StreamDelta) -> int:
        """A chat with tools or a reasoning parser (plain otherwise): each choice's text through
        its own reader, reasoning as ``reasoning_content`` deltas and content as it releases
        them, each call as one ``tool_calls`` delta; at the input's final
        each of its choices ends, ``finish_reason`` ``tool_calls`` where it made calls."""
        base = index * self.n
        choice = base + delta.index
        if not self.plain and (delta.token_ids or not self.started[choice]):
            # The delta's ids, log-probabilities and usage so far in a chunk of their own: its
            # text comes as the reader releases it.
            self.out += self._detailed(index, choice, dataclasses.replace(delta, text=""))
        if delta.text:
            self._tool_pieces(choice, delta.text)
        if delta.result is None:
            return 0
        self.finals[index] = result = checked(delta.result)
        for seq in result.choices:
            choice = base + seq.index
            self._tool_pieces(choice, None)
            reason = _tool_finish(seq.finish_reason) if self.called[choice] else seq.finish_reason
            self.out += self.enc.finish(choice, reason, None, self._usage(index))
        return 1

    def _tool_pieces(self, choice: int, text: str | None) -> None:
        """Feed ``text`` (None: the end) to choice ``choice``'s reader; its chunks to :attr:`out`."""
        reading = self.tools[choice](text)  # type: ignore[index]
        if reading.reasoning or reading.opened:  # an empty think block: reasoning_content "", as whole
            self.out += self.enc.chunk(choice, None, None, {"delta": {"reasoning_content": reading.reasoning}})
        if reading.content:
            self.out += self.enc.text(choice, reading.content)
        if reading.calls:
            self.called[choice] = True
            self.out += self.enc.chunk(choice, None, None, {"delta": {"tool_calls": reading.calls}})

    def _detailed(self, index: int, choice: int, delta: StreamDelta) -> bytes:
        text = delta.text
        extra: dict[str, Any] = {}
        first = not self.started[choice]
        if first:
            self.started[choice] = True
            if self.prompts.echoes is not None:
                text = self.prompts.echoes[index] + text
            if self.token_ids and self.enc.kind != CHAT:
                extra["prompt_token_ids"] = self.prompts.ids[index]  # type: ignore[index]
        if self.token_ids:
            extra["token_ids"] = list(delta.token_ids)
        if self.logged:
            prompt_rows = delta.prompt_logprobs
            if prompt_rows is not None:
                self.prompt_rows[index] = prompt_rows
            elif first:  # n > 1: a sequence's first chunk after another's brought the prompt's
                prompt_rows = self.prompt_rows.get(index)
            fields = _logprob_fields(
                self.job, self.prompts, index, delta.logprobs, prompt_rows, self.offsets[choice], first
            )
            if fields.get("logprobs") and self.enc.kind == COMPLETION:
                self.offsets[choice] += sum(len(t) for t in fields["logprobs"]["tokens"])
            extra.update(fields)
        self.generated[index] += len(delta.token_ids)
        return self.enc.chunk(choice, text, None, extra, self._usage(index))

    def _usage(self, index: int) -> dict[str, int] | None:
        if not self.continuous:
            return None
        return usage_so_far(len(self.prompts.ids[index]), self.generated[index])  # type: ignore[index]
