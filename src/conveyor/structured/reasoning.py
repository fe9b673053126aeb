"""Reasoning out of model text: the ``<think>...</think>`` part of an answer split from its
content, whole (:func:`split_reasoning`) or streamed (:class:`ReasoningParser`).

Two formats, chosen by the server's ``--reasoning-parser`` (the model decides which it writes):

- ``qwen3``: reasoning only where the answer opens with ``<think>`` (Qwen3's template with
  thinking off renders an empty think block into the prompt, and the answer is all content).
- ``deepseek_r1``: the answer starts inside the think block (DeepSeek-R1's template ends the
  prompt with ``<think>``), so everything up to ``</think>`` is reasoning, all of it when the
  block never closes; an opening ``<think>`` the model writes anyway is dropped.

The tags are left out, and so are the newlines around them (the templates write
``<think>\\n...\\n</think>\\n\\n``); an answer without a think block is its content as it
came. Streamed, text that may still become a tag is held back until the next piece or the end
decides it, so concatenating the deltas of any chunking gives :func:`split_reasoning` of the
whole text. Tool calls are read from the content alone. :func:`reasoning_token_count` counts
an answer's reasoning in tokens (the ``reasoning_tokens`` of the usage), by the tags' token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Format = Literal["qwen3", "deepseek_r1"]
FORMATS: tuple[Format, ...] = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    """What one piece adds: reasoning text and/or content text."""

    reasoning: str = ""
    content: str = ""


def _held_tail(text: str, tag: str) -> int:
    """How many last characters of ``text`` may be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """One answer's text, piece by piece: :meth:`feed` per piece, :meth:`finish` at the end."""

    def __init__(self, format: str) -> None:
        if format not in FORMATS:
            raise ValueError(f"unknown reasoning format {format!r} (one of {', '.join(FORMATS)})")
        self.implicit = format == "deepseek_r1"  # the answer starts inside the think block
        self.state = "start"  # start (undecided) -> reasoning -> content
        self.buffer = ""
        self.lead = True  # the current part has shown no text yet: its leading newlines go
        self.reasoned = False

    def feed(self, text: str) -> ReasoningDelta:
        self.buffer += text
        out = ReasoningDelta()
        while True:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(OPEN):
                    self.buffer = stripped[len(OPEN) :]
                    self._enter("reasoning")
                elif OPEN.startswith(stripped):  # empty, or a piece of the tag: not decided yet
                    return out
                else:
                    self._enter("reasoning" if self.implicit else "content")
                    self.lead = self.implicit  # no think block: the content is the answer as it came
            elif self.state == "reasoning":
                end = self.buffer.find(CLOSE)
                if end < 0:
                    keep = _held_tail(self.buffer, CLOSE)
                    body = self.buffer[: len(self.buffer) - keep]
                    kept = len(body.rstrip("\n"))  # newlines before the close are not reasoning
                    out.reasoning += self._shown(body[:kept])
                    self.buffer = self.buffer[kept:]
                    return out
                out.reasoning += self._shown(self.buffer[:end].rstrip("\n"))
                self.buffer = self.buffer[end + len(CLOSE) :]
                self._enter("content")
            else:
                out.content += self._shown(self.buffer)
                self.buffer = ""
                return out

    def finish(self) -> ReasoningDelta:
        """The held text, now that no more comes: a think block never closed is reasoning."""
        held, self.buffer = self.buffer, ""
        if self.state == "start":
            if self.implicit:
                self._enter("reasoning")
                return ReasoningDelta(reasoning=self._shown(held.strip().removeprefix(OPEN).rstrip("\n")))
            return ReasoningDelta(content=held)  # no think block: the answer as it came
        if self.state == "reasoning":
            return ReasoningDelta(reasoning=self._shown(held.rstrip("\n")))
        return ReasoningDelta(content=self._shown(held))

    def _enter(self, state: str) -> None:
        self.state, self.lead = state, True
        if state == "reasoning":
            self.reasoned = True

    def _shown(self, text: str) -> str:
        if self.lead:
            text = text.lstrip("\n")
            self.lead = not text
        return text


def split_reasoning(text: str, format: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole answer; reasoning None where it had no think block."""
    parser = ReasoningParser(format)
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if parser.reasoned else None), first.content + last.content


def reasoning_token_count(token_ids: list[int], open_id: int, close_id: int) -> int:
    """The tokens inside the think block of an answer that had one (its tags not counted, as the
    reasoning budget counts them): from after its first ``<think>`` token (the start where the
    template opened the block) up to its first ``</think>`` token (the end where it never closed)."""
    start = token_ids.index(open_id) + 1 if open_id in token_ids else 0
    try:
        return token_ids.index(close_id, start) - start
    except ValueError:
        return len(token_ids) - start
