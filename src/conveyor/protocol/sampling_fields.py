"""The sampling fields of a generate map: each checked for type and range into
:class:`~conveyor.ipc.messages.SamplingParams`, and the server-configured bound on
log-probabilities (:func:`logprobs_problem`)."""

from __future__ import annotations

import math
from typing import Any

from conveyor.ipc.messages import MAX_LOGIT_BIAS, SamplingParams
from conveyor.protocol.limits import MAX_N, MAX_STOP_TOKEN_IDS, MIN_SEED, SEED_END
from conveyor.protocol.validation import is_int, is_number
from conveyor.protocol.wire import ProtocolError

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "n",
    "speculate",
    "pooling",
)
# Log-probabilities asked for (None: none; k: the token's own and the k most likely), bounded
# by the server's max_logprobs (:func:`logprobs_problem`).
LOGPROBS_FIELDS = ("logprobs", "prompt_logprobs")
# Pooling of an embedding request (conveyor.worker.pooling): the last prompt position's final
# hidden state, or their mean over the prompt; both L2-normalized.
POOLING_METHODS = ("last", "mean")


def parse_sampling(obj: dict[str, Any], request_id: str | None = None) -> SamplingParams:
    """Sampling fields of a generate map, each checked for type and range."""

    def get(name: str, default: Any) -> Any:
        value = obj.get(name)
        return default if value is None else value

    def fail(msg: str) -> ProtocolError:
        return ProtocolError(msg, request_id)

    max_tokens = get("max_tokens", 16)
    if not is_int(max_tokens) or max_tokens < 1:
        raise fail(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    temperature = get("temperature", 1.0)
    if not is_number(temperature) or temperature < 0:
        raise fail(f"'temperature' must be a number >= 0, got {temperature!r}")
    top_p = get("top_p", 1.0)
    if not is_number(top_p) or not 0 < top_p <= 1:
        raise fail(f"'top_p' must be in (0, 1], got {top_p!r}")
    top_k = get("top_k", 0)
    if not is_int(top_k) or top_k < 0:
        raise fail(f"'top_k' must be an integer >= 0 (0 disables it), got {top_k!r}")
    min_p = get("min_p", 0.0)
    if not is_number(min_p) or not 0 <= min_p <= 1:
        raise fail(f"'min_p' must be in [0, 1], got {min_p!r}")
    seed = obj.get("seed")
    if seed is not None:
        if not is_int(seed) or not MIN_SEED <= seed < SEED_END:
            raise fail(f"'seed' must be a 64-bit integer, in [-2**63, 2**64), got {seed!r}")
        seed = signed_seed(seed)
    stop_token_ids = get("stop_token_ids", [])
    if isinstance(stop_token_ids, list) and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:  # counted before read
        raise fail(f"'stop_token_ids' has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    if not isinstance(stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in stop_token_ids):
        raise fail("'stop_token_ids' must be an array of non-negative integers")
    flags = {name: get(name, default) for name, default in (("ignore_eos", False), ("speculate", True))}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise fail(f"'{name}' must be a boolean")
    n = get("n", 1)
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise fail(f"'n' must be an integer in [1, {MAX_N}], got {n!r}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = get(name, 0.0)
        if not is_number(value) or not -2 <= value <= 2:
            raise fail(f"'{name}' must be in [-2, 2], got {value!r}")
        penalties[name] = float(value)
    repetition_penalty = get("repetition_penalty", 1.0)
    if not is_number(repetition_penalty) or not 0 < repetition_penalty < math.inf:
        raise fail(f"'repetition_penalty' must be a number > 0, got {repetition_penalty!r}")
    min_tokens = get("min_tokens", 0)
    if not is_int(min_tokens) or min_tokens < 0:  # (and at most max_tokens: context_problem)
        raise fail(f"'min_tokens' must be an integer >= 0, got {min_tokens!r}")
    logit_bias = _parse_logit_bias(get("logit_bias", {}), fail)
    for name in LOGPROBS_FIELDS:
        value = obj.get(name)
        if value is not None and (not is_int(value) or value < 0):
            raise fail(f"'{name}' must be an integer >= 0 (the number of top log-probabilities), got {value!r}")
    pooling = _parse_pooling(obj, n, fail)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(min_p),
        seed=seed,
        stop_token_ids=list(stop_token_ids),
        n=n,
        repetition_penalty=float(repetition_penalty),
        min_tokens=min_tokens,
        logit_bias=logit_bias,
        **penalties,
        **flags,
        logprobs=obj.get("logprobs"),
        prompt_logprobs=obj.get("prompt_logprobs"),
        pooling=pooling,
    )


def _parse_pooling(obj: dict[str, Any], n: int, fail: Any) -> str:
    """``pooling``: an embedding request ("last" or "mean"; absent: a generate request). It
    samples nothing, so it takes no ``n`` > 1 nor log-probabilities."""
    pooling = obj.get("pooling")
    if pooling is None:
        return ""
    if pooling not in POOLING_METHODS:
        raise fail(f"'pooling' must be one of {', '.join(map(repr, POOLING_METHODS))}, got {pooling!r}")
    if n > 1:
        raise fail("'n' > 1 asks for several sequences; a pooling request samples none: drop 'n' or 'pooling'")
    for name in LOGPROBS_FIELDS:
        if obj.get(name) is not None:
            raise fail(
                f"'{name}' asks for log-probabilities; a pooling request samples none: drop '{name}' or 'pooling'"
            )
    return pooling


def _parse_logit_bias(value: Any, fail: Any) -> dict[int, float]:
    """``logit_bias``: a map of token id (an integer, or its decimal string: JSON's keys are
    strings) to a bias in [-100, 100], at most :data:`MAX_LOGIT_BIAS` entries. The ids are
    checked against the vocabulary with the context (:func:`context_problem`)."""
    if not isinstance(value, dict):
        raise fail("'logit_bias' must be a map of token id to bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise fail(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    bias = {}
    for key, number in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not is_int(token) or token < 0:
            raise fail(f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}")
        if not is_number(number) or not -100 <= number <= 100:
            raise fail(f"'logit_bias' values must be in [-100, 100], got {number!r} for token {token}")
        bias[token] = float(number)
    return bias


def logprobs_problem(sampling: SamplingParams, max_logprobs: int) -> str | None:
    """Why a request asks for more top log-probabilities than the server's bound
    (``--max-logprobs``), or None. Applied where the server's configuration is known: the
    frontend and the engine, before tokenizing."""
    for name in LOGPROBS_FIELDS:
        k = getattr(sampling, name)
        if k is not None and k > max_logprobs:
            return f"'{name}' asks for {k} log-probabilities; this server's bound (--max-logprobs) is {max_logprobs}"
    return None


def signed_seed(seed: int) -> int:
    """``seed`` as the signed 64-bit integer with its low 64 bits: seeds in [0, 2**63) are
    themselves, a negative seed its own value, and [2**63, 2**64) the negative it reads as in
    two's complement. Deterministic, so any 64-bit seed gives a reproducible stream."""
    seed &= SEED_END - 1
    return seed - SEED_END if seed > 2**63 - 1 else seed
