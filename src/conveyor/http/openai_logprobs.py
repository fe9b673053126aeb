"""Log-probabilities in OpenAI's shapes, from the client protocol's columns
(docs/protocol.md, "Log-probabilities").

- Completions (``logprobs: k``): per choice ``{tokens, token_logprobs, top_logprobs,
  text_offset}``; ``top_logprobs`` rows map token text to value, the k most likely and the
  chosen token (so k or k + 1 entries, as vLLM gives); ``text_offset`` is each token's
  character offset in the choice's text, counting the tokens' texts from ``offset`` on.
  With ``echo`` the prompt's tokens come first, the first one with ``null`` value and top.
- Chat (``logprobs: true``, ``top_logprobs: k``): ``{content: [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}]}``.
- ``prompt_logprobs`` (vLLM's extension): per prompt token ``null`` (the first) or
  ``{id: {logprob, rank, decoded_token}}`` with the token and the k most likely (rank: 1 for
  the most likely; the token's own rank only where it is among them, else null).

JSON has no infinities: a ``-inf`` (a token the model gives no mass in float32) is sent as
-9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from typing import Any

FLOOR = -9999.0


def _value(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def completion_logprobs(
    rows: dict[str, Any] | None, offset: int = 0, echo: dict[str, Any] | None = None, first_token: str | None = None
) -> dict[str, Any]:
    """The completions ``logprobs`` object of ``rows`` (output columns; None: no rows), after
    ``echo``'s prompt columns when given (with ``first_token``, the prompt's first token's
    text, which has no value). ``offset``: the text offset of the first token listed."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if echo is not None:
        tokens.append(first_token or "")
        values.append(None)
        tops.append(None)
    for part in (echo, rows):
        if not part:
            continue
        for token, value, top_tokens, top_values in zip(
            part["tokens"], part["token_logprobs"], part["top_tokens"], part["top_logprobs"]
        ):
            tokens.append(token)
            values.append(_value(value))
            top = {t: _value(v) for t, v in zip(top_tokens, top_values)}
            top.setdefault(token, _value(value))
            tops.append(top)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _entry(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "logprob": _value(value), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(rows: dict[str, Any] | None) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``rows`` (None: no tokens)."""
    if not rows:
        return {"content": []}
    return {
        "content": [
            {**_entry(token, value), "top_logprobs": [_entry(t, v) for t, v in zip(top_tokens, top_values)]}
            for token, value, top_tokens, top_values in zip(
                rows["tokens"], rows["token_logprobs"], rows["top_tokens"], rows["top_logprobs"]
            )
        ]
    }


def prompt_logprobs(rows: dict[str, Any], prompt_ids: list[int]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` list for a prompt of ``prompt_ids`` (rows from index 1)."""
    out: list[dict[str, Any] | None] = [None]
    for i, (token, value, top_ids, top_tokens, top_values) in enumerate(
        zip(rows["tokens"], rows["token_logprobs"], rows["top_token_ids"], rows["top_tokens"], rows["top_logprobs"])
    ):
        token_id = prompt_ids[rows["start"] + i]
        entry = {
            str(t): {"logprob": _value(v), "rank": rank, "decoded_token": s}
            for rank, (t, s, v) in enumerate(zip(top_ids, top_tokens, top_values), 1)
        }
        entry.setdefault(str(token_id), {"logprob": _value(value), "rank": None, "decoded_token": token})
        out.append(entry)
    return out
