"""A request body as JSON, within the client protocol's decode limits, or a 400 naming the field.

Every body the HTTP face forwards becomes one client message (msgpack), which the frontend
decodes with :mod:`conveyor.protocol.limits`' bounds; a body outside them used to reach the
frontend and come back as an ``error`` map, which this process answered with a 500 (a
``logit_bias`` of 257 entries, a schema with 300 properties), or to fail the decoder itself
(JSON nested ~990 deep: a ``RecursionError`` and a traceback). So the body is checked here,
before anything else reads it: nesting at most :data:`MAX_JSON_DEPTH`, objects at most
:data:`MAX_MAP_LEN` keys, arrays at most :data:`MAX_ARRAY_LEN` items; what exceeds one is a
400 whose ``param`` is the top-level field that holds it.

Cost: the body is walked only when it could break a bound (more than ``MAX_JSON_DEPTH``
brackets, counted at C speed, or over 64 KiB), and the walk looks into containers only: about
50 ms for a body of a million token ids, nothing for an ordinary request.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.http.errors import ApiError, bad_field
from conveyor.protocol.limits import MAX_ARRAY_LEN, MAX_JSON_DEPTH, MAX_MAP_LEN

_decode = msgspec.json.Decoder().decode


def decode_body(data: bytes) -> Any:
    """The decoded body; :class:`ApiError` 400 for bad JSON or JSON past the limits above."""
    try:
        body = _decode(data)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # deeper than the decoder's stack: far past MAX_JSON_DEPTH
        raise ApiError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    # Nesting past the bound takes that many brackets; an object past it, 5 bytes a key at least.
    if data.count(b"{") + data.count(b"[") > MAX_JSON_DEPTH or len(data) > 4 * MAX_MAP_LEN:
        check_shape(body)
    return body


def check_shape(body: Any) -> None:
    """A 400 naming the top-level field of ``body`` that nests deeper than
    :data:`MAX_JSON_DEPTH` or holds an object or array over its bound."""
    if isinstance(body, dict):
        if len(body) > MAX_MAP_LEN:
            raise ApiError(400, f"the request body has {len(body)} fields; at most {MAX_MAP_LEN} are allowed")
        for name, value in body.items():
            problem = _problem(value, 2)
            if problem is not None:
                raise bad_field(str(name), f"'{name}' {problem}")
    else:
        problem = _problem(body, 1)
        if problem is not None:
            raise ApiError(400, f"the request body {problem}")


def _problem(value: Any, depth: int) -> str | None:
    """What in ``value`` (at nesting ``depth``) breaks a bound, or None. Iterative: no
    recursion, whatever the nesting."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            if len(item) > MAX_MAP_LEN:
                return f"holds an object of {len(item)} keys; at most {MAX_MAP_LEN} are allowed"
            children = item.values()
        elif isinstance(item, list):
            if len(item) > MAX_ARRAY_LEN:
                return f"holds an array of {len(item)} items; at most {MAX_ARRAY_LEN} are allowed"
            children = item
        else:
            continue
        if level > MAX_JSON_DEPTH:
            return f"nests deeper than {MAX_JSON_DEPTH} levels"
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return None
