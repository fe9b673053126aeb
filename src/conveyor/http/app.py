"""The aiohttp applications of the HTTP process: the OpenAI API and the metrics-only one.

:func:`api_app` serves ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings``,
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``,
``POST /invocations`` (a completion or a chat request, told apart by the body's
``prompt`` or ``messages``, as vLLM routes it), Anthropic's ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens`` (:mod:`conveyor.http.anthropic_requests`; their errors in
Anthropic's shape, their key also as ``x-api-key``), ``GET /tokenizer_info``, ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (:mod:`conveyor.http.adapters`), an RL trainer's routes
(:mod:`conveyor.http.rl_routes`), ``GET /version``, ``GET /health`` and ``GET
/metrics``; :func:`metrics_app` (the ``--metrics-port`` listener) ``/metrics`` and
``/health`` alone.

API keys (``--api-key``, :class:`Access`): when the server has any, every route but
:data:`OPEN_PATHS` (``/health``, ``/metrics``, ``/version``; those too with
``--api-key-everywhere``) needs ``Authorization: Bearer <key>``; anything else is a 401
with the OpenAI error object. Every response carries ``x-request-id``
(:mod:`conveyor.http.request_ids`). Keys are compared in constant time
(:func:`hmac.compare_digest`, every key tried) so the time taken says nothing about them. Every error, aiohttp's own
included (unknown path 404, wrong method 405, body over the limit 413), leaves as the OpenAI
error object (:mod:`conveyor.http.errors`) through :func:`error_middleware`.

Bodies are bounded by :data:`MAX_BODY_BYTES`: the client protocol's message limit less a
headroom that covers what the forwarded map may add to the body's size (the fields the HTTP
process adds, and msgpack's longer headers of strings over 64 KiB: at most 3 bytes each;
see the size invariant of :mod:`conveyor.http.openai_requests`), so a body that is accepted
here is never refused by the frontend for its size.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import prometheus_client
from aiohttp import web

from conveyor.http import adapters, prometheus, request_ids, rl_routes
from conveyor.http.adapters import LORAS
from conveyor.http.anthropic_requests import messages_job, thinking_budget
from conveyor.http.anthropic_responses import error_body as anthropic_error_body
from conveyor.http.anthropic_responses import respond_message
from conveyor.http.connections import BODY_TIMEOUT, BODY_TIMEOUT_S, COUNTS, Guard
from conveyor.http.embeddings import embeddings_body, embeddings_job
from conveyor.http.errors import ApiError, bad_field, unavailable
from conveyor.http.generation import ignored_fields, respond
from conveyor.http.job_runs import STARTED_RESPONSE, generate_all
from conveyor.http.json_body import decode_body
from conveyor.http.link import FrontendLink
from conveyor.http.openai_requests import CHAT, COMPLETION, parse_request
from conveyor.http.openai_responses import json_encode
from conveyor.http.reasoning_budget import budgeted
from conveyor.http.responses_output import respond_response
from conveyor.http.responses_requests import responses_job
from conveyor.http.tokenizer_info import tokenizer_info
from conveyor.http.tokens import Tokens
from conveyor.protocol.limits import MAX_CLIENT_MESSAGE_BYTES, MAX_TEMPLATE_KWARGS_BYTES
from conveyor.version import __version__

log = logging.getLogger("conveyor.http")

BODY_HEADROOM_BYTES = 4096 + MAX_TEMPLATE_KWARGS_BYTES  # chat_template_kwargs may grow when packed
MAX_BODY_BYTES = MAX_CLIENT_MESSAGE_BYTES - BODY_HEADROOM_BYTES
# A scrape waits this long for the frontend's metrics and the scheduler's stats.
SCRAPE_TIMEOUT_S = 5.0

LINK = web.AppKey("link", FrontendLink)
MODEL = web.AppKey("model", str)
MAX_MODEL_LEN = web.AppKey("max_model_len", int)
CREATED = web.AppKey("created", int)
TOKENS = web.AppKey("tokens", Tokens)
TOOL_PARSER = web.AppKey(
    "tool_parser", object
)  # --tool-call-parser: a format of conveyor.structured.tool_calls, or None
REASONING_PARSER = web.AppKey(
    "reasoning_parser", object
)  # --reasoning-parser: a format of conveyor.structured.reasoning, or None
ACCESS = web.AppKey("access", object)
MAX_WAITING = web.AppKey("max_waiting", int)  # --max-waiting (absent: no per-request share)
GUARD = web.AppKey("guard", Guard)  # the listener's connection guard (absent: none, as in tests)
STRICT_FIELDS = web.AppKey("strict_fields", bool)  # --strict-fields: an unknown request field is a 400
# Routes open without a key unless --api-key-everywhere.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
# Most tokens one /tokenize or /detokenize call handles (the model length bounds real use).
MAX_TOKENIZE_IDS = 1 << 20


@dataclass(frozen=True)
class Access:
    """Who may call: ``keys`` (none: everyone), and whether :data:`OPEN_PATHS` need one too."""

    keys: tuple[bytes, ...] = ()
    everywhere: bool = False

    @classmethod
    def of(cls, keys: Sequence[str], everywhere: bool = False) -> Access:
        return cls(tuple(k.encode() for k in keys), everywhere)

    def allows(self, request: web.Request) -> bool:
        if not self.keys or (request.path in OPEN_PATHS and not self.everywhere):
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not given and request.path.startswith(ANTHROPIC_PATH):  # Anthropic's clients send x-api-key
            given = request.headers.get("x-api-key", "").strip().encode()
        matched = False
        for key in self.keys:  # every key compared, in constant time each
            matched |= hmac.compare_digest(given, key)
        return matched


# The Messages API's routes: their errors are in Anthropic's shape, their key may come as x-api-key.
ANTHROPIC_PATH = "/v1/messages"


def error_response(error: ApiError, path: str = "") -> web.Response:
    body = anthropic_error_body(error) if path.startswith(ANTHROPIC_PATH) else error.body()
    return web.Response(status=error.status, body=json_encode(body), content_type="application/json")


# Each handler carries its route: API_ROUTES are served by --http-port alone; PROBE_ROUTES
# (/health, /metrics) by --http-port and by --metrics-port.
API_ROUTES = web.RouteTableDef()
PROBE_ROUTES = web.RouteTableDef()


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as the OpenAI error object with its status (cancellation passes through);
    a request without a valid key (when keys are set) goes no further than here. The
    listener's guard is told when the request starts and ends (its header timer waits meanwhile)."""
    guard = request.app.get(GUARD)
    if guard is None:
        return await _handled(request, handler)
    guard.request_started(request.transport)
    try:
        return await _handled(request, handler)
    finally:
        guard.request_ended(request.transport)


async def _handled(request: web.Request, handler) -> web.StreamResponse:
    request_ids.assign(request)
    try:
        if not request.app[ACCESS].allows(request):
            raise ApiError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                type="invalid_request_error",
            )
        return await handler(request)
    except ApiError as exc:
        response = error_response(exc, request.path)
        if exc.status == 408:  # the body's rest may still come: the connection cannot be reused
            response.force_close()
        return response
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
        return error_response(ApiError(exc.status, message, code=code), request.path)
    except Exception as exc:  # a bug: logged once here, answered once
        log.exception("%s %s failed", request.method, request.path)
        started = request.get(STARTED_RESPONSE)
        if started is not None:  # its status is sent already: the stream it began is the answer
            return started
        return error_response(
            ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"), request.path
        )


async def _body(request: web.Request) -> Any:
    try:
        timeout = request.app.get(BODY_TIMEOUT, BODY_TIMEOUT_S)
        data = await asyncio.wait_for(request.read(), timeout)  # 413 past client_max_size
    except asyncio.TimeoutError:
        counts = request.app.get(COUNTS)
        if counts is not None:
            counts.note("body_timeout")
        raise ApiError(
            408, f"the request body did not arrive within {timeout:g} s (--http-body-timeout)", code="request_timeout"
        ) from None
    return decode_body(data)


@API_ROUTES.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETION)


@API_ROUTES.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT)


@API_ROUTES.post("/invocations")
async def invocations(request: web.Request) -> web.StreamResponse:
    """A completion or a chat request by the body's shape (``messages`` or ``prompt``)."""
    body = await _body(request)
    if isinstance(body, dict) and "messages" in body:
        kind = CHAT
    elif isinstance(body, dict) and "prompt" in body:
        kind = COMPLETION
    else:
        raise ApiError(400, "/invocations takes a chat body (with 'messages') or a completion body (with 'prompt')")
    return await _respond(request, kind, body)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    return await _respond(request, kind, await _body(request))


async def _respond(request: web.Request, kind: str, body: Any) -> web.StreamResponse:
    app = request.app
    loras = await adapters.known_model(
        app, app[LINK], body.get("model") if isinstance(body, dict) else None, app[MODEL]
    )
    job = parse_request(kind, body, app[MODEL], loras, app.get(STRICT_FIELDS, False))
    if kind == CHAT:
        job = budgeted(job, body.get("max_reasoning_tokens"), app.get(REASONING_PARSER))
    _check_share(job, app.get(MAX_WAITING, 0))
    return await respond(
        request,
        app[LINK],
        job,
        job.options.get("lora") or app[MODEL],
        app[TOKENS],
        app[TOOL_PARSER],
        app.get(REASONING_PARSER),
    )


@API_ROUTES.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API: the body as the chat request it means
    (:mod:`conveyor.http.responses_requests`), answered as response objects and their events."""
    app = request.app
    body = await _body(request)
    loras = await adapters.known_model(
        app, app[LINK], body.get("model") if isinstance(body, dict) else None, app[MODEL]
    )
    parsed = responses_job(body, app[MODEL], loras, app.get(STRICT_FIELDS, False))
    parsed = replace(parsed, job=budgeted(parsed.job, body.get("max_reasoning_tokens"), app.get(REASONING_PARSER)))
    _check_share(parsed.job, app.get(MAX_WAITING, 0))
    headers = ignored_fields(request_ids.request_id(request), parsed.job)
    model = parsed.job.options.get("lora") or app[MODEL]
    return await respond_response(
        request, app[LINK], parsed, model, app[TOKENS], app[TOOL_PARSER], app.get(REASONING_PARSER), headers
    )


@API_ROUTES.get("/v1/responses/{response_id}")
async def stored_response(request: web.Request) -> web.Response:
    """Always a 404: Conveyor keeps no responses (``store: true`` is refused)."""
    raise ApiError(
        404,
        f"no response '{request.match_info['response_id']}': this server keeps no responses ('store' is not supported)",
        param="response_id",
        code="response_not_found",
    )


@API_ROUTES.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's embeddings: pooling requests, one per input (:mod:`conveyor.http.embeddings`)."""
    app, body = request.app, await _body(request)
    loras = await adapters.known_model(
        app, app[LINK], body.get("model") if isinstance(body, dict) else None, app[MODEL]
    )
    job, encoding = embeddings_job(body, app[MODEL], loras, app.get(STRICT_FIELDS, False))
    _check_share(job, app.get(MAX_WAITING, 0))
    await app[LINK].require_started()
    results = await generate_all(app[LINK], job)
    headers = ignored_fields(request_ids.request_id(request), job)
    return _json(embeddings_body(results, job.options.get("lora") or app[MODEL], encoding), headers=headers)


@API_ROUTES.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API: the body as the chat request it means
    (:mod:`conveyor.http.anthropic_requests`), answered in Anthropic's shapes."""
    app = request.app
    body = await _body(request)
    loras = await adapters.known_model(
        app, app[LINK], body.get("model") if isinstance(body, dict) else None, app[MODEL]
    )
    job = messages_job(body, app[MODEL], loras, app.get(STRICT_FIELDS, False))
    if app.get(REASONING_PARSER) is not None:
        job = budgeted(job, thinking_budget(body), app[REASONING_PARSER], "thinking")
    elif thinking_budget(body) is not None:  # no reasoning parser: no think block to cap
        job = replace(job, ignored=tuple(sorted([*job.ignored, "thinking.budget_tokens"])))
    headers = ignored_fields(request_ids.request_id(request), job)
    return await respond_message(
        request,
        app[LINK],
        job,
        job.options.get("lora") or app[MODEL],
        app[TOOL_PARSER],
        headers,
        app.get(REASONING_PARSER),
    )


@API_ROUTES.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """``{input_tokens}``: the tokens a ``/v1/messages`` body's prompt renders to (its system,
    messages and tools through the chat template), as ``/tokenize`` counts them."""
    app = request.app
    body = await _body(request)
    loras = await adapters.known_model(
        app, app[LINK], body.get("model") if isinstance(body, dict) else None, app[MODEL]
    )
    job = messages_job(body, app[MODEL], loras, app.get(STRICT_FIELDS, False), count_only=True)
    options = {k: v for k, v in job.options.items() if k not in ("fill_context", "lora")}
    ids = await app[TOKENS].prompt_ids(job.inputs[0], options)
    return _json({"input_tokens": len(ids)}, headers=ignored_fields(request_ids.request_id(request), job))


@API_ROUTES.get("/tokenizer_info")
async def get_tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's ``GET /tokenizer_info`` (:mod:`conveyor.http.tokenizer_info`)."""
    return _json(await tokenizer_info(request.app[TOKENS]))


def _check_share(job: Any, max_waiting: int) -> None:
    """A 400 for a request of more sequences (prompts x ``best_of`` or ``n``) than a quarter
    of ``--max-waiting``: one request of 1,024 prompts x ``n`` 64 filled the queue, and every
    other client got 429 until it ended. The whole HTTP face is one client of the frontend,
    so the share is per HTTP request."""
    share = max_waiting // 4
    width = job.options.get("best_of") or job.n
    if not share or not isinstance(width, int) or len(job.inputs) * width <= share:
        return
    name = "prompt" if width == 1 else ("best_of" if job.options.get("best_of") else "n")
    raise bad_field(
        name,
        f"this request asks for {len(job.inputs) * width} sequences ({len(job.inputs)} prompt(s) x {width}); one "
        "request may take "
        f"at most {share}, a quarter of the server's --max-waiting {max_waiting}: split it",
    )


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json_encode(obj), content_type="application/json", headers=headers)


def _card(app: web.Application) -> dict[str, Any]:
    return {
        "id": app[MODEL],
        "object": "model",
        "created": app[CREATED],
        "owned_by": "conveyor",
        "max_model_len": app[MAX_MODEL_LEN],
    }


def _lora_card(app: web.Application, name: str) -> dict[str, Any]:
    """A LoRA adapter's card: vLLM's, whose ``parent`` is the base model."""
    return {**_card(app), "id": name, "root": name, "parent": app[MODEL]}


@API_ROUTES.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    app = request.app
    loras = await adapters.refresh_loras(app, app[LINK])
    return _json({"object": "list", "data": [_card(app), *(_lora_card(app, name) for name in loras)]})


@API_ROUTES.get("/v1/models/{model:.+}")
async def model_card(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the served model's or an adapter's card, or a 404 error object."""
    name = request.match_info["model"]
    if name in await adapters.known_model(request.app, request.app[LINK], name, request.app[MODEL]):
        return _json(_lora_card(request.app, name))
    if name != request.app[MODEL]:
        raise ApiError(
            404,
            f"the model '{name}' does not exist; this server serves '{request.app[MODEL]}'",
            param="model",
            code="model_not_found",
        )
    return _json(_card(request.app))


@API_ROUTES.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` (:mod:`conveyor.http.adapters`)."""
    return await adapters.update(request.app, request.app[LINK], request.app[MODEL], await _body(request), load=True)


@API_ROUTES.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/unload_lora_adapter`` ``{lora_name}`` (:mod:`conveyor.http.adapters`)."""
    return await adapters.update(request.app, request.app[LINK], request.app[MODEL], await _body(request), load=False)


@API_ROUTES.get("/version")
async def version(request: web.Request) -> web.Response:
    return _json({"version": __version__})


@API_ROUTES.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: ``{prompt}`` or ``{messages}`` (vLLM's body, with its
    ``add_special_tokens``, ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template_kwargs``) -> ``{tokens, count, max_model_len}``: the ids a generate
    request with that input would run on (:meth:`Tokens.prompt_ids`)."""
    app = request.app
    body = await _body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    fields = {
        "prompt": (str,),
        "messages": (list,),
        "model": (str,),
        "add_special_tokens": (bool,),
        "add_generation_prompt": (bool,),
        "continue_final_message": (bool,),
        "chat_template_kwargs": (dict,),
        "return_token_strs": (bool,),
    }
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_field(unknown[0], f"unrecognized request field(s): {', '.join(map(repr, unknown))}")
    if body.get("model") is not None and body["model"] != app[MODEL]:
        raise ApiError(
            404,
            f"the model '{body['model']}' does not exist; this server serves '{app[MODEL]}'",
            param="model",
            code="model_not_found",
        )
    chat = body.get("messages") is not None
    options = {
        k: body[k]
        for k in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
        if body.get(k) is not None
    }
    if chat:
        job = parse_request(CHAT, {"model": app[MODEL], "messages": body["messages"], **options}, app[MODEL])
    else:
        if options:
            raise bad_field(sorted(options)[0], f"'{sorted(options)[0]}' applies to 'messages' only")
        job = parse_request(COMPLETION, {"model": app[MODEL], "prompt": body.get("prompt")}, app[MODEL])
        if len(job.inputs) != 1:
            raise bad_field("prompt", "'prompt' must be one string (or one array of token ids)")
    tokens = app[TOKENS]
    add_special = body.get("add_special_tokens")
    if chat and add_special:
        raise bad_field(
            "add_special_tokens",
            "'add_special_tokens' with 'messages': only false or null is accepted (the template writes them)",
        )
    options = {k: v for k, v in job.options.items() if k != "fill_context"}
    add = not (add_special is False and "prompt" in job.inputs[0])
    answer = await tokens.tokenize(
        job.inputs[0], options, add_special_tokens=add, token_strs=bool(body.get("return_token_strs"))
    )
    ids = answer["token_ids"]
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": app[MAX_MODEL_LEN], "tokens": ids}
    if body.get("return_token_strs"):
        reply["token_strs"] = answer["token_strs"]
    return _json(reply)


@API_ROUTES.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    """``POST /detokenize``: ``{tokens}`` -> ``{prompt}``, the ids decoded as they are."""
    body = await _body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") is not None and body["model"] != request.app[MODEL]:
        raise ApiError(404, f"the model '{body['model']}' does not exist", param="model", code="model_not_found")
    ids = body.get("tokens")
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_TOKENIZE_IDS
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise bad_field("tokens", f"'tokens' must be an array of at most {MAX_TOKENIZE_IDS} token ids")
    return _json({"prompt": await request.app[TOKENS].decode(ids)})


@PROBE_ROUTES.get("/health")
async def health(request: web.Request) -> web.Response:
    """200 when the frontend relayed a stats query that the scheduler answered within
    HEALTH_TIMEOUT_S (so all three processes are up) and no worker is hung; 503 otherwise."""
    if await request.app[LINK].healthy():
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")
    raise unavailable(
        "the server is not healthy: the scheduler did not answer a stats query in time, or a worker is hung "
        "(--hang-timeout)",
        "unhealthy",
    )


@PROBE_ROUTES.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """The Prometheus exposition of the frontend's metrics and the scheduler's stats (the
    latter left out when the scheduler does not answer in time: the counters still scrape)."""
    link = request.app[LINK]
    try:
        frontend_metrics = await link.metrics(SCRAPE_TIMEOUT_S)
    except Exception as exc:
        raise unavailable(
            f"the frontend did not answer the metrics query: {exc or type(exc).__name__}", "unhealthy"
        ) from None
    try:
        stats = await link.stats(SCRAPE_TIMEOUT_S)
    except Exception:
        stats = None
    counts = request.app.get(COUNTS)
    body = prometheus.exposition(
        frontend_metrics, stats, request.app[MODEL], counts.snapshot() if counts is not None else None
    )
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


def _app(
    link: FrontendLink,
    model: str,
    max_model_len: int,
    created: int,
    tokens: Tokens | None,
    access: Access | None,
    loras: Sequence[str] = (),
) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[error_middleware])
    app[LINK] = link
    app[MODEL] = model
    app[LORAS] = list(loras)
    app[MAX_MODEL_LEN] = max_model_len
    app[CREATED] = created
    app[TOKENS] = tokens or Tokens(None, max_model_len, link)
    app[ACCESS] = access or Access()
    app.on_response_prepare.append(request_ids.echo)
    return app


def api_app(
    link: FrontendLink,
    model: str,
    max_model_len: int,
    created: int,
    tokens: Tokens | None = None,
    access: Access | None = None,
    loras: Sequence[str] = (),
    tool_call_parser: str | None = None,
    strict_fields: bool = False,
    reasoning_parser: str | None = None,
) -> web.Application:
    app = _app(link, model, max_model_len, created, tokens, access, loras)
    app[TOOL_PARSER] = tool_call_parser
    app[REASONING_PARSER] = reasoning_parser
    app[STRICT_FIELDS] = strict_fields
    app.add_routes(API_ROUTES)
    app.add_routes(rl_routes.routes(LINK))
    app.add_routes(PROBE_ROUTES)
    return app


def metrics_app(
    link: FrontendLink,
    model: str,
    max_model_len: int,
    created: int,
    tokens: Tokens | None = None,
    access: Access | None = None,
    loras: Sequence[str] = (),
) -> web.Application:
    app = _app(link, model, max_model_len, created, tokens, access, loras)
    app.add_routes(PROBE_ROUTES)
    return app
