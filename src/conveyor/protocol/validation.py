"""The rules a generate request's values obey once it is tokenized, and the field type tests.

:func:`context_problem` is the one statement of the context rules (ids within the
vocabulary, room for ``max_tokens`` within the model length). The frontend applies it to
every tokenized request (:func:`check_tokenized`); the scheduler applies it again at its own
entry, because it also takes requests from in-process callers that never pass the frontend
(the engine, tests); for a request from the frontend that check always passes. The worker
does not repeat these rules: it checks only that each plan agrees with its own state
(:mod:`conveyor.worker.plan_check`, its trust boundary).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from conveyor.protocol.wire import INVALID_INPUT, PROMPT_TOO_LONG, ProtocolError


class Checked(Protocol):
    """What :func:`check_tokenized` reads of a parsed generate request
    (:class:`~conveyor.protocol.requests.GenerateRequest`, whose module imports this one)."""

    request_id: str
    sampling: Any


def is_int(v: Any) -> bool:
    """An integer that is not a bool (JSON and msgpack keep the two apart; Python does not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def context_problem(
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_token_ids: Sequence[int],
    vocab_size: int | None,
    max_model_len: int,
    *,
    check_ids: bool = True,
    bias_token_ids: Sequence[int] = (),
    min_tokens: int = 0,
) -> str | None:
    """Why a request with this whole context as token ids (a continuation's earlier turns
    included) cannot run on this model, or None: the one statement of these rules. The
    frontend applies it to every tokenized request (:func:`check_tokenized`); the scheduler
    applies it again at its entry, to what in-process callers hand it directly (the engine,
    tests). The prompt
    is not empty, its ids (unless ``check_ids`` is False: ids the tokenizer made are known to
    be in range) and the stop token ids are within ``[0, vocab_size)`` (None: vocabulary
    unknown, only negatives are refused), ``max_tokens`` is at least 1 and the prompt leaves
    room for it within ``max_model_len``; so are the ``logit_bias`` ids (``bias_token_ids``),
    and ``min_tokens`` is at most ``max_tokens`` (checked here, where ``max_tokens`` is final)."""
    if not len(prompt_ids):
        return "prompt tokenizes to zero tokens: the prompt is empty"
    if max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}"
    if min_tokens > max_tokens:
        return f"min_tokens={min_tokens} exceeds max_tokens={max_tokens}"
    limit = vocab_size if vocab_size is not None else math.inf
    checks = (
        ("token id", prompt_ids, check_ids),
        ("stop token id", stop_token_ids, True),
        ("logit_bias token id", bias_token_ids, True),
    )
    for what, ids, checked in checks:
        if checked and len(ids) and (min(ids) < 0 or max(ids) >= limit):  # min/max: C speed on long prompts
            bad = next(t for t in ids if not 0 <= t < limit)
            return f"{what} {bad} is outside the vocabulary [0, {vocab_size})"
    return _length_problem(len(prompt_ids), max_tokens, max_model_len)


def _length_problem(n: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why an ``n``-token context with room for ``max_tokens`` does not fit the model, or None."""
    if n >= max_model_len:
        return f"prompt has {n} tokens; the model's limit is {max_model_len} including output"
    if n + max_tokens > max_model_len:
        return (
            f"max_tokens={max_tokens} with a {n}-token prompt exceeds the model length {max_model_len}; "
            f"at most {max_model_len - n} new tokens fit within max_model_len"
        )
    return None


def check_tokenized(
    req: Checked, prompt_ids: list[int], vocab_size: int, max_model_len: int, *, check_ids: bool = True
) -> None:
    """:func:`context_problem` for a parsed generate request, raised as :class:`ProtocolError`."""
    problem = context_problem(
        prompt_ids,
        req.sampling.max_tokens,
        req.sampling.stop_token_ids,
        vocab_size,
        max_model_len,
        check_ids=check_ids,
        bias_token_ids=list(req.sampling.logit_bias),
        min_tokens=req.sampling.min_tokens,
    )
    if problem is not None:
        too_long = problem == _length_problem(len(prompt_ids), req.sampling.max_tokens, max_model_len)
        code = PROMPT_TOO_LONG if too_long else INVALID_INPUT
        raise ProtocolError(problem, req.request_id, code)
