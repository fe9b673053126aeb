"""How a chat job's answer is read, for every API: its reasoning split off by the server's
``--reasoning-parser`` (:mod:`conveyor.structured.reasoning`), then its content read for tool
calls (:class:`conveyor.http.tool_reading.ToolReader`), so a call written inside the think
block is reasoning, never a call. Each API writes the three parts its own way (chat's
``reasoning_content``, a Responses ``reasoning`` item, a Messages ``thinking`` block); the
usage's ``reasoning_tokens`` count the think block's tokens by the tags' token ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.client import CompletionResult
from conveyor.http.openai_requests import CHAT, GenerationJob
from conveyor.http.tokens import Tokens
from conveyor.http.tool_reading import ToolReader, tool_reader
from conveyor.structured.reasoning import ReasoningParser, reasoning_token_count, split_reasoning


@dataclass
class Reading:
    """What a piece (or a whole answer) holds: reasoning, content, tool calls (OpenAI's shape)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    opened: bool = False  # the think block began here (a block may have no text: ``<think></think>``)


class OutputReader:
    """The reasoning format (None: no split) and the tool reader (None: no calls read) of a job."""

    def __init__(
        self, reasoning: str | None, tools: ToolReader | None, think_ids: tuple[int, int] | None = None
    ) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.think_ids = think_ids  # the <think> and </think> token ids (reasoning_tokens), where known

    def reasoning_tokens(self, results: list[CompletionResult]) -> int:
        """The think blocks' tokens over every choice of ``results`` (0 where a choice had none)."""
        if self.reasoning is None or self.think_ids is None:
            return 0
        return sum(
            reasoning_token_count(seq.token_ids, *self.think_ids)
            for r in results
            for seq in r.choices
            if split_reasoning(seq.text, self.reasoning)[0] is not None
        )

    def whole(self, text: str) -> tuple[str | None, str, list[dict[str, Any]]]:
        """``(reasoning, content, calls)``; reasoning None where the answer had no think block."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = split_reasoning(text, self.reasoning)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.whole(text)
        return reasoning, text, calls

    def stream(self) -> Callable[[str | None], Reading]:
        """A feeder: ``feed(text)`` per delta, ``feed(None)`` at the end."""
        split = ReasoningParser(self.reasoning) if self.reasoning is not None else None
        tools = self.tools.stream() if self.tools is not None else None

        def feed(text: str | None) -> Reading:
            if split is None:
                reading = Reading(content=text or "")
            else:
                before = split.reasoned
                delta = split.feed(text) if text is not None else split.finish()
                reading = Reading(delta.reasoning, delta.content, opened=split.reasoned and not before)
            if tools is not None:
                content, calls = tools(reading.content) if text is not None else _last(tools, reading.content)
                reading.content, reading.calls = content, calls
            return reading

        return feed


def _last(
    tools: Callable[[str | None], tuple[str, list[dict[str, Any]]]], text: str
) -> tuple[str, list[dict[str, Any]]]:
    """The tool reader's last release: ``text`` (what the splitter held) fed, then its end."""
    content, calls = tools(text) if text else ("", [])
    more, more_calls = tools(None)
    return content + more, calls + more_calls


def output_reader(job: GenerationJob, tool_parser: str | None, reasoning_parser: str | None) -> OutputReader | None:
    """The reader of a chat job's answer (None: its text is all content). A forcing
    ``tool_choice`` constrains the answer to the calls' JSON from its first token: no think block."""
    if job.kind != CHAT:
        return None
    tools = tool_reader(job, tool_parser)
    reasoning = reasoning_parser if job.forced_tool_choice is None else None
    if tools is None and reasoning is None:
        return None
    return OutputReader(reasoning, tools)


async def counting_reader(
    job: GenerationJob, tool_parser: str | None, reasoning_parser: str | None, tokens: Tokens
) -> OutputReader | None:
    """:func:`output_reader` with the think tags' ids where it splits reasoning (for the usage's
    ``reasoning_tokens``): asked before the job runs, so a tokenizer without them fails nothing started."""
    reader = output_reader(job, tool_parser, reasoning_parser)
    if reader is not None and reader.reasoning is not None:
        reader.think_ids = await tokens.think_ids()
    return reader
