"""Log-probabilities on their way out: the scheduler's columns kept per request, with the
top tokens' strings, for the client protocol's deltas and final and for the engine.

The worker computes them for the requests that ask (:mod:`conveyor.worker.sampler`,
``logprobs_of``); each iteration's share of a request arrives as a
:class:`~conveyor.ipc.messages.TokenLogprobs` on its ``RequestOutput`` (rows at the step's
width, the largest k of its batch: a request keeps its own k). A :class:`LogprobsLog` per
request and kind (output tokens, prompt tokens) takes them in order, cut where a stop string
cut the tokens, and hands out what is new since the last delta and the whole for the final,
as the protocol's columns (docs/protocol.md, "Log-probabilities"). Token strings are the
tokenizer's text of each id alone, special tokens included (what vLLM returns), memoized by
the tokenizer. Torch-free: the frontend and the engine both use it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from conveyor.ipc.messages import TokenLogprobs


class _Decodes(Protocol):
    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str: ...


class TopLogprob(NamedTuple):
    token_id: int
    token: str
    logprob: float


class Logprob(NamedTuple):
    """One token's entry (the engine's form): its id, string and log-probability, and the
    request's k most likely tokens at its position, most likely first."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob]


class LogprobsLog:
    """The log-probabilities of one request's tokens of one kind, ``k`` top entries each,
    from sequence index ``start`` (1 for a prompt: its first token has none; the prompt's
    length for the output)."""

    def __init__(self, k: int, start: int, tokenizer: _Decodes) -> None:
        self.k = k
        self.start = start
        self._tokenizer = tokenizer
        self.values: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_values: list[list[float]] = []
        self._sent = 0  # rows handed to a delta already

    def __len__(self) -> int:
        return len(self.values)

    def add(self, lp: TokenLogprobs, rows: int | None = None) -> None:
        """Take the first ``rows`` rows of ``lp`` (all by default), which must continue the
        log where it ends (a gap or an overlap is a bug upstream: refused)."""
        n = lp.count if rows is None else min(rows, lp.count)
        if lp.start != self.start + len(self.values):
            raise ValueError(f"log-probabilities for index {lp.start}, expected {self.start + len(self.values)}")
        k = min(self.k, lp.width)
        self.values += np.frombuffer(lp.token_logprobs, "<f4", n).tolist()
        if lp.width:
            ids = np.asarray(lp.top_ids, np.int64).reshape(-1, lp.width)[:n, :k]
            values = np.frombuffer(lp.top_logprobs, "<f4", n * lp.width).reshape(-1, lp.width)[:n, :k]
            self.top_ids += ids.tolist()
            self.top_values += values.tolist()
        else:
            self.top_ids += [[] for _ in range(n)]
            self.top_values += [[] for _ in range(n)]

    def columns(self, token_ids: list[int], since: int = 0) -> dict[str, Any]:
        """The protocol's columns of rows ``since..``; ``token_ids[i]`` is row ``i``'s token."""
        string = self._tokenizer.decode_one
        top_ids = self.top_ids[since:]
        return {
            "start": self.start + since,
            "tokens": [string(t, False) for t in token_ids[since : len(self.values)]],
            "token_logprobs": self.values[since:],
            "top_token_ids": top_ids,
            "top_tokens": [[string(t, False) for t in row] for row in top_ids],
            "top_logprobs": self.top_values[since:],
        }

    def take_new(self, token_ids: list[int]) -> dict[str, Any] | None:
        """The columns of the rows no delta carried yet (None when there are none)."""
        since = self._sent
        if since == len(self.values):
            return None
        self._sent = len(self.values)
        return self.columns(token_ids, since)

    def entries(self, token_ids: list[int]) -> list[Logprob]:
        """Every row as a :class:`Logprob` (``token_ids[i]`` is row ``i``'s token)."""
        string = self._tokenizer.decode_one
        return [
            Logprob(t, string(t, False), v, [TopLogprob(i, string(i, False), w) for i, w in zip(ids, ws)])
            for t, v, ids, ws in zip(token_ids, self.values, self.top_ids, self.top_values)
        ]


def join(first: TokenLogprobs | None, second: TokenLogprobs | None) -> TokenLogprobs | None:
    """Two consecutive stretches of one request's log-probabilities as one (widths may
    differ: the narrower is padded with its last column, which no reader past its own k
    ever looks at: a request's k is at most either step's width)."""
    if first is None or second is None:
        return first if second is None else second
    width = max(first.width, second.width)

    def widened(lp: TokenLogprobs) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(lp.top_ids, np.int32).reshape(lp.count, lp.width)
        values = np.frombuffer(lp.top_logprobs, "<f4").reshape(lp.count, lp.width)
        if lp.width < width:
            pad = width - lp.width
            ids = np.pad(ids, ((0, 0), (0, pad)), mode="edge") if lp.width else np.zeros((lp.count, width), np.int32)
            values = np.pad(values, ((0, 0), (0, pad)), mode="edge") if lp.width else np.zeros((lp.count, width), "<f4")
        return ids, values

    (ids1, v1), (ids2, v2) = widened(first), widened(second)
    return TokenLogprobs(
        first.start,
        first.count + second.count,
        width,
        first.token_logprobs + second.token_logprobs,
        np.concatenate((ids1, ids2)).reshape(-1),
        np.concatenate((v1, v2)).astype("<f4").tobytes(),
    )
