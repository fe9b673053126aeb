"""Tool calls out of model text, as OpenAI ``tool_calls``, whole or streamed.

Two formats, chosen by the server's flag (the model decides which it writes):

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the text; the text outside them is content.
- ``llama3`` (Llama 3.1+ JSON tool calling): the whole answer is ``{"name": ...,
  "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated by ``;``.
  An answer that does not start that way is content.

:class:`ToolCallParser` takes text in whatever chunks detokenizing yields and returns what
can be shown so far: content is released as soon as it cannot be the start of a tool call,
and each call as one delta (id, name and all its arguments) once its text is complete. What
does not parse as a call is content, never lost. Concatenating the deltas of any chunking
gives :func:`parse_tool_calls` of the whole text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Format = Literal["hermes", "llama3"]
FORMATS: tuple[Format, ...] = ("hermes", "llama3")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """What one chunk adds: content text and/or finished tool calls (OpenAI delta entries)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ToolCallParser:
    format: Format
    make_id: Callable[[], str] = new_call_id
    _buffer: str = ""
    _count: int = 0
    _in_call: bool = False  # hermes: inside <tool_call>; llama3: the answer is tool calls
    _decided: bool = False  # llama3: the first non-space text has been seen

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown tool-call format {self.format!r} (one of {', '.join(FORMATS)})")

    def feed(self, text: str) -> ToolCallDelta:
        self._buffer += text
        return self._hermes(final=False) if self.format == "hermes" else self._llama3(final=False)

    def finish(self) -> ToolCallDelta:
        """The end of the output: whatever is held back is released (as a call if it parses)."""
        return self._hermes(final=True) if self.format == "hermes" else self._llama3(final=True)

    def _call(self, obj: Any, args_key: str) -> dict[str, Any] | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(args_key, {})
        if isinstance(args, str):  # some models write the arguments already serialized
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        call = {
            "index": self._count,
            "id": self.make_id(),
            "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
        }
        self._count += 1
        return call

    def _hermes(self, *, final: bool) -> ToolCallDelta:
        out = ToolCallDelta()
        while True:
            if not self._in_call:
                at = self._buffer.find(HERMES_OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, HERMES_OPEN)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(HERMES_OPEN) :]
                self._in_call = True
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0 and not final:
                return out
            body = self._buffer if end < 0 else self._buffer[:end]
            call = self._call(_loads(body), "arguments")
            if call is None:
                out.content += HERMES_OPEN + body + ("" if end < 0 else HERMES_CLOSE)
            else:
                out.tool_calls.append(call)
            self._buffer = "" if end < 0 else self._buffer[end + len(HERMES_CLOSE) :]
            self._in_call = False
            if end < 0:
                return out

    def _llama3(self, *, final: bool) -> ToolCallDelta:
        out = ToolCallDelta()
        if not self._decided:
            head = self._buffer.lstrip()
            if not head or (not final and _partial_suffix(head, PYTHON_TAG) == len(head)):
                if final:
                    out.content, self._buffer = self._buffer, ""
                return out
            self._decided = True
            self._in_call = head.startswith(("{", PYTHON_TAG))
        if not self._in_call:
            out.content, self._buffer = self._buffer, ""
            return out
        if not final:
            return out  # calls are known only whole: one answer may still turn out to be text
        calls = _llama3_calls(self._buffer)
        if calls is None:
            out.content = self._buffer
        else:
            out.tool_calls = [c for obj in calls if (c := self._call(obj, "parameters")) is not None]
        self._buffer = ""
        return out


def _llama3_calls(text: str) -> list[Any] | None:
    """The JSON objects of a Llama 3 tool-call answer, or None if it is not one."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        calls.append(obj)
        rest = text[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        at = len(text) - len(rest)
    return calls or None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str, format: Format, make_id: Callable[[], str] = new_call_id) -> ToolCallDelta:
    """The whole output at once: its content and its tool calls."""
    parser = ToolCallParser(format, make_id)
    first, last = parser.feed(text), parser.finish()
    return ToolCallDelta(first.content + last.content, first.tool_calls + last.tool_calls)
