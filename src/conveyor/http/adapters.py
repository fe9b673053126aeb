"""LoRA adapters over HTTP: vLLM's ``POST /v1/load_lora_adapter`` and ``POST
/v1/unload_lora_adapter``, and the adapter names ``model`` may take.

The bodies are vLLM's (:data:`LOAD_FIELDS`, :data:`UNLOAD_FIELDS`), checked here field by field.
The routes are clients of the frontend's ``load_lora`` / ``unload_lora`` (docs/protocol.md):
the frontend refuses them unless bin/serve runs with ``--enable-lora-loading``, the
scheduler and worker check the adapter. Statuses as vLLM gives them: 200 with a plain-text
``Success: ...`` body; 400 for a missing field, a name already loaded or an adapter that does
not fit the model; 404 for an adapter directory or file that is not there, an unload of a
name not loaded, and the routes with loading off (vLLM leaves them out then). Conveyor adds
409 for an unload refused while requests run or wait under the adapter, or an update while
another of the name is unanswered, and 504 for one some replica left unanswered.

Which names are adapters: the frontend's ``stats`` lists them (``lora_adapters``), and the
server may change them through any client, so this process keeps the list it last saw in
the app (:data:`LORAS`) and asks again when a request names a model it does not know, and
for ``/v1/models``, before it answers 404.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from conveyor.client import ServerError
from conveyor.http.errors import ApiError, bad_field
from conveyor.http.link import FrontendLink, api_error
from conveyor.protocol import wire

LORAS = web.AppKey(
    "loras", list
)  # the LoRA adapters' names as last seen: models a request may name beside the served one
# A refresh of the adapters' names waits this long for the stats query.
REFRESH_TIMEOUT_S = 5.0

_STATUS_OF_CODE = {
    wire.LORA_ALREADY_LOADED: 400,
    wire.LORA_INVALID: 400,
    wire.INVALID_FIELD: 400,
    wire.LORA_NOT_FOUND: 404,
    wire.LORA_LOADING_DISABLED: 404,
    wire.LORA_IN_USE: 409,
    wire.LORA_UPDATE_PENDING: 409,
    wire.TIMEOUT: 504,
}


async def refresh_loras(app: web.Application, link: FrontendLink) -> list[str]:
    """The adapters' names as the server has them now (kept in the app); the names last seen
    when the server does not answer."""
    try:
        stats = await link.stats(REFRESH_TIMEOUT_S)
    except Exception:  # unreachable or slow: the request is answered by what was last seen
        return app[LORAS]
    app[LORAS][:] = stats.get("lora_adapters", [])
    return app[LORAS]


async def known_model(app: web.Application, link: FrontendLink, model: Any, served: str) -> list[str]:
    """The adapters' names, asked again when ``model`` is neither the served model nor a
    name last seen (an adapter loaded since)."""
    if isinstance(model, str) and model != served and model not in app[LORAS]:
        return await refresh_loras(app, link)
    return app[LORAS]


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _int_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


# The bodies of vLLM's LoadLoRAAdapterRequest and UnloadLoRAAdapterRequest: field -> (required,
# its check, what it must be). Conveyor names adapters by name only: ``lora_int_id`` (vLLM's own
# id of a loaded adapter) is checked and ignored; ``load_inplace`` true asks to replace a loaded
# adapter's weights, which Conveyor does not do (:func:`update`).
LOAD_FIELDS = {
    "lora_name": (True, _text, "a non-empty string"),
    "lora_path": (True, _text, "a non-empty string"),
    "load_inplace": (False, _flag, "a boolean"),
}
UNLOAD_FIELDS = {
    "lora_name": (True, _text, "a non-empty string"),
    "lora_int_id": (False, _int_or_null, "an integer or null"),
}


def _fields(body: Any, spec: dict[str, tuple[bool, Callable[[Any], bool], str]]) -> dict[str, Any]:
    """The body, checked against ``spec``: a JSON object of known fields, the required ones
    present, each of its type (a 400 naming the first field that is not)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(spec))
    if unknown:
        raise bad_field(unknown[0], f"unrecognized field(s): {', '.join(map(repr, unknown))}")
    for name, (required, valid, what) in spec.items():
        if name in body and not valid(body[name]):
            raise bad_field(name, f"{name!r} must be {what}")
        if required and name not in body:
            raise bad_field(name, f"{name!r} is required: {what}")
    return body


async def update(app: web.Application, link: FrontendLink, served: str, body: Any, load: bool) -> web.Response:
    """Load (``load``) or unload the adapter the body names; the plain-text success or the
    error object with its status (module docstring)."""
    body = _fields(body, LOAD_FIELDS if load else UNLOAD_FIELDS)
    name, path = body["lora_name"], body.get("lora_path")
    if load and name == served:
        raise bad_field("lora_name", f"'{name}' is the served model's name; give the adapter another")
    await link.require_started()
    try:
        if load:
            await link.client.load_lora(name, path)
        else:
            await link.client.unload_lora(name)
    except ServerError as exc:
        status = _STATUS_OF_CODE.get(exc.code)
        if status is None:
            raise api_error(exc) from None
        message = str(exc)
        if exc.code == wire.LORA_ALREADY_LOADED and body.get("load_inplace"):
            message += (
                "; load_inplace: Conveyor does not replace a loaded adapter's weights in place: unload it "
                "(once no request uses it), then load the new ones"
            )
        raise ApiError(status, message, param="lora_name", code=exc.code) from None
    except Exception as exc:
        raise api_error(exc) from None
    await refresh_loras(app, link)
    done = f"loaded from {path}" if load else "unloaded"
    return web.Response(text=f"Success: LoRA adapter '{name}' {done}.", content_type="text/plain")
