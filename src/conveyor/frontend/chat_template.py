"""The chat-template sandbox: a message list rendered to prompt text as transformers renders it.

Chat templates ship with checkpoints, so they are untrusted code. They render in jinja2's
immutable sandbox configured like transformers' (``trim_blocks``/``lstrip_blocks``, loop
controls, the ``{% generation %}`` tag, a ``tojson`` that keeps non-ASCII,
``raise_exception``, ``strftime_now``, and ``dict``/``namespace`` that expose nothing beyond
what templates use). Messages are copied into plain JSON types first, so a template only
ever sees the builtin types the sandbox knows to be safe. :class:`conveyor.frontend.tokenizer.Tokenizer`
picks a checkpoint's template and encodes what :func:`render` returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning travels under; templates read the first (gpt-oss reads "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render(template: str, messages: list, add_generation_prompt: bool, variables: Mapping[str, Any]) -> str:
    """The prompt text of ``messages`` under ``template``, with ``variables`` (the named special
    tokens, and a request's ``chat_template_kwargs``) defined. ValueError for messages that are not
    a list of maps, a template that does not compile, or one that fails while rendering
    (``raise_exception`` included)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"each message must be an object with 'role' and 'content', got {message!r}")
        chat.append(_alias_reasoning({k: _plain(v) for k, v in message.items() if v is not None}))
    try:
        # ``tools`` and ``documents`` are None unless ``variables`` sets them (a request's tools).
        return _compile(template).render(
            messages=chat,
            add_generation_prompt=add_generation_prompt,
            **{"tools": None, "documents": None, **variables},
        )
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template error: {exc}") from None


# ---------------------------------------------------------------------- message preparation


def _plain(value: Any) -> Any:
    """A fresh copy of ``value`` made of JSON types only.

    Templates are untrusted code run in a sandbox that only knows which methods of the
    builtin types are safe; anything else (bytes from msgpack, custom objects) becomes an
    inert ``<typename>`` placeholder, as transformers does.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    """Expose a message's reasoning under the names templates read (``reasoning_content``, ``thinking``)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# ---------------------------------------------------------------------- the template sandbox


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; it renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys`` only: the builtin type itself would expose its attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters and non-ASCII; templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None
