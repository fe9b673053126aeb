"""The aiohttp applications of the HTTP process: the OpenAI API and the metrics-only one.

:func:`api_app` serves ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` and ``GET /metrics``; :func:`metrics_app` (the
``--metrics-port`` listener) ``/metrics`` and ``/health`` alone. Every error, aiohttp's own
included (unknown path 404, wrong method 405, body over the limit 413), leaves as the OpenAI
error object (:mod:`conveyor.http.errors`) through :func:`error_middleware`.

Bodies are bounded by :data:`MAX_BODY_BYTES`: the client protocol's message limit less a
headroom that covers what the forwarded map may add to the body's size (the fields the HTTP
process adds, and msgpack's longer headers of strings over 64 KiB: at most 3 bytes each;
see the size invariant of :mod:`conveyor.http.openai_requests`), so a body that is accepted
here is never refused by the frontend for its size.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import prometheus_client
from aiohttp import web

from conveyor.http import prometheus
from conveyor.http.errors import ApiError, unavailable
from conveyor.http.generation import respond
from conveyor.http.link import FrontendLink
from conveyor.http.openai_requests import CHAT, COMPLETION, parse_request
from conveyor.http.openai_responses import json_encode
from conveyor.protocol.messages import MAX_CLIENT_MESSAGE_BYTES

log = logging.getLogger("conveyor.http")

BODY_HEADROOM_BYTES = 4096
MAX_BODY_BYTES = MAX_CLIENT_MESSAGE_BYTES - BODY_HEADROOM_BYTES
# A scrape waits this long for the frontend's metrics and the scheduler's stats.
SCRAPE_TIMEOUT_S = 5.0

LINK = web.AppKey("link", FrontendLink)
MODEL = web.AppKey("model", str)
MAX_MODEL_LEN = web.AppKey("max_model_len", int)
CREATED = web.AppKey("created", int)

_json_decode = msgspec.json.Decoder().decode


def error_response(error: ApiError) -> web.Response:
    return web.Response(status=error.status, body=json_encode(error.body()), content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as the OpenAI error object with its status (cancellation passes through)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        message = exc.text or exc.reason
        if exc.status == 413:
            message = f"the request body exceeds the limit of {MAX_BODY_BYTES} bytes"
        elif exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        return error_response(ApiError(exc.status, message, code=code))
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))


async def _body(request: web.Request) -> Any:
    data = await request.read()  # 413 past client_max_size
    try:
        return _json_decode(data)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETION)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    job = parse_request(kind, await _body(request), app[MODEL])
    return await respond(request, app[LINK], job, app[MODEL])


async def models(request: web.Request) -> web.Response:
    app = request.app
    card = {"id": app[MODEL], "object": "model", "created": app[CREATED], "owned_by": "conveyor", "max_model_len": app[MAX_MODEL_LEN]}
    return web.Response(body=json_encode({"object": "list", "data": [card]}), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """200 when the frontend relayed a stats query that the scheduler answered within
    HEALTH_TIMEOUT_S (so all three processes are up); 503 otherwise."""
    if await request.app[LINK].healthy():
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")
    raise unavailable("the server is not healthy: the scheduler did not answer a stats query in time", "unhealthy")


async def metrics(request: web.Request) -> web.Response:
    """The Prometheus exposition of the frontend's metrics and the scheduler's stats (the
    latter left out when the scheduler does not answer in time: the counters still scrape)."""
    link = request.app[LINK]
    try:
        frontend_metrics = await link.metrics(SCRAPE_TIMEOUT_S)
    except Exception as exc:
        raise unavailable(f"the frontend did not answer the metrics query: {exc or type(exc).__name__}", "unhealthy") from None
    try:
        stats = await link.stats(SCRAPE_TIMEOUT_S)
    except Exception:
        stats = None
    body = prometheus.exposition(frontend_metrics, stats)
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


def _app(link: FrontendLink, model: str, max_model_len: int, created: int) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware])
    app[LINK] = link
    app[MODEL] = model
    app[MAX_MODEL_LEN] = max_model_len
    app[CREATED] = created
    return app


def api_app(link: FrontendLink, model: str, max_model_len: int, created: int) -> web.Application:
    app = _app(link, model, max_model_len, created)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def metrics_app(link: FrontendLink, model: str, max_model_len: int, created: int) -> web.Application:
    app = _app(link, model, max_model_len, created)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
