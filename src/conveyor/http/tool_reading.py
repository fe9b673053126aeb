"""How a chat job's output is read for tool calls (:class:`ToolReader`), for every API that
has tools: the constrained JSON of a forcing ``tool_choice``, or the server's
``--tool-call-parser`` format. The calls come out in OpenAI's shape (``{index, id, type,
function: {name, arguments}}``, arguments as JSON text); each API writes them its own way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.http.openai_requests import CHAT, GenerationJob
from conveyor.structured.tool_calls import ToolCallParser, parse_tool_calls
from conveyor.structured.tool_choice import constrained_tool_calls


class ToolReader:
    """How a chat job's output is read for tool calls: the constrained JSON of a forcing
    ``tool_choice`` (read whole at the end), or the server's parser format (streamed: content
    released as soon as it cannot start a call, each call as one delta)."""

    def __init__(self, forced: Any, format: str | None) -> None:
        self.forced, self.format = forced, format

    def whole(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.forced is not None:
            try:
                return "", constrained_tool_calls(text, self.forced)
            except (ValueError, KeyError, TypeError):  # cut short (length): not a whole call
                return text, []
        parsed = parse_tool_calls(text, self.format)  # type: ignore[arg-type]
        return parsed.content, parsed.tool_calls

    def stream(self) -> Callable[[str | None], tuple[str, list[dict[str, Any]]]]:
        """A feeder: ``feed(text)`` per delta, ``feed(None)`` at the end."""
        if self.forced is not None:
            held: list[str] = []

            def feed_forced(text: str | None) -> tuple[str, list[dict[str, Any]]]:
                if text is not None:
                    held.append(text)
                    return "", []
                return self.whole("".join(held))

            return feed_forced
        parser = ToolCallParser(self.format)  # type: ignore[arg-type]

        def feed(text: str | None) -> tuple[str, list[dict[str, Any]]]:
            delta = parser.finish() if text is None else parser.feed(text)
            return delta.content, delta.tool_calls

        return feed


def tool_reader(job: GenerationJob, tool_parser: str | None) -> ToolReader | None:
    if job.kind != CHAT or not job.tools:
        return None
    if job.forced_tool_choice is not None:
        return ToolReader(job.forced_tool_choice, None)
    return ToolReader(None, tool_parser) if tool_parser else None
