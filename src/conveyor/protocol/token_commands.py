"""The ``tokenize`` and ``detokenize`` client messages (docs/protocol.md): the frontend
tokenizes for its clients, the HTTP process included, which so loads no tokenizer. A
``tokenize`` input is read by the generate parser, so it is bounded and refused with the same
messages as a generate's; either is answered under its ``request_id`` (refusals: an
``error`` map)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.protocol.limits import MAX_REQUEST_ID_LEN
from conveyor.protocol.wire import DETOKENIZE, GENERATE, TOKENIZE, CommandError, ProtocolError

# The most token ids one detokenize may carry.
MAX_DETOKENIZE_IDS = 1 << 20
# Fields of a tokenize besides its input and the chat template's: they are its own.
_TOKENIZE_OWN = frozenset({"type", "v", "request_id", "add_special_tokens", "return_token_strs"})
# What a tokenize may carry of the generate fields: its input and what renders a chat.
TOKENIZE_INPUT = frozenset(
    {
        "prompt",
        "messages",
        "token_ids",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "tools",
        "truncate_prompt_tokens",
    }
)
DETOKENIZE_FIELDS = frozenset({"type", "v", "request_id", "token_ids"})


@dataclass
class TokenizeCommand:
    """``request``: the input as a generate request reads it; ``add_special_tokens`` False:
    a text prompt without BOS; ``return_token_strs``: the reply also lists each id's token."""

    request_id: str
    request: Any  # conveyor.protocol.requests.GenerateRequest
    add_special_tokens: bool = True
    return_token_strs: bool = False


@dataclass
class DetokenizeCommand:
    request_id: str
    token_ids: list[int]


def _request_id(obj: dict[str, Any], kind: str) -> str:
    rid = obj.get("request_id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_LEN:
        raise CommandError(f"{kind} needs 'request_id': a non-empty string of at most {MAX_REQUEST_ID_LEN} characters")
    return rid


def parse_tokenize(obj: dict[str, Any], parse_generate) -> TokenizeCommand:
    """A ``tokenize`` map; ``parse_generate`` reads its input (the generate parser)."""
    rid = _request_id(obj, TOKENIZE)
    unknown = set(obj) - _TOKENIZE_OWN - TOKENIZE_INPUT
    if unknown:
        raise CommandError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}", rid)
    flags = {}
    for name, default in (("add_special_tokens", True), ("return_token_strs", False)):
        value = obj.get(name)
        if value is not None and not isinstance(value, bool):
            raise CommandError(f"'{name}' must be a boolean, got {value!r}", rid)
        flags[name] = default if value is None else value
    fields = {k: v for k, v in obj.items() if k in TOKENIZE_INPUT}
    try:
        req = parse_generate({"type": GENERATE, "request_id": rid, "max_tokens": 1, **fields})
    except ProtocolError as exc:
        raise CommandError(str(exc), rid, exc.code) from None
    return TokenizeCommand(rid, req, **flags)


def parse_detokenize(obj: dict[str, Any]) -> DetokenizeCommand:
    rid = _request_id(obj, DETOKENIZE)
    unknown = set(obj) - DETOKENIZE_FIELDS
    if unknown:
        raise CommandError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}", rid)
    ids = obj.get("token_ids")
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_DETOKENIZE_IDS
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise CommandError(f"'token_ids' must be an array of at most {MAX_DETOKENIZE_IDS} token ids", rid)
    return DetokenizeCommand(rid, ids)
