"""Each HTTP request's id: the client's ``x-request-id`` where it is safe to use, else a new one.

Load tools and gateways send ``x-request-id`` to follow a request through the services it
crosses; vLLM makes it the request's id. Here it is echoed in the response's
``x-request-id`` header on every response (errors and streams included; a new id when the
request had none), and a generate response's ``id`` (``chatcmpl-<id>``, ``msg_<id>``) and
its log lines use it when it is *safe*: at most :data:`MAX_ID_CHARS` characters of
``[A-Za-z0-9._:-]``, so that no client can put quotes, spaces or control characters into
the JSON ids or log lines built from it. An unsafe id is still echoed as it came (aiohttp
has refused a header with CR/LF already), while the response's id is a new one. The id is
the HTTP face's only: the frontend's protocol request ids stay its client's own, so two
requests that send the same ``x-request-id`` never collide there.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

REQUEST_ID_HEADER = "x-request-id"
MAX_ID_CHARS = 128
_SAFE_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_ID_CHARS}}}")
# Typed request keys where aiohttp has them (3.14+; a plain string key warns there).
_RequestKey = getattr(web, "RequestKey", None)
_KEY = _RequestKey("request_id", str) if _RequestKey else "conveyor.request_id"
_ECHO = _RequestKey("request_id_echo", str) if _RequestKey else "conveyor.request_id_echo"


def assign(request: web.Request) -> None:
    """Give ``request`` its id (the middleware does, before the handler runs)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    safe = given is not None and _SAFE_ID.fullmatch(given) is not None
    request[_KEY] = given if safe else uuid.uuid4().hex
    request[_ECHO] = given if given else request[_KEY]


def request_id(request: web.Request) -> str:
    """The id of ``request`` (a new one for a request the middleware has not seen, as in tests)."""
    if _KEY not in request:
        assign(request)
    return request[_KEY]


async def echo(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the ``x-request-id`` header on every response."""
    if _ECHO not in request:
        assign(request)
    response.headers[REQUEST_ID_HEADER] = request[_ECHO]
