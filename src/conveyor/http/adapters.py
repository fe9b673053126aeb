"""LoRA adapters over HTTP: vLLM's ``POST /v1/load_lora_adapter`` and ``POST
/v1/unload_lora_adapter``, and the adapter names ``model`` may take.

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

from typing import Any

from aiohttp import web

from conveyor.client import ServerError
from conveyor.http.errors import ApiError, bad_field
from conveyor.http.link import FrontendLink, api_error
from conveyor.protocol import wire

LORAS = web.AppKey("loras", list)  # the LoRA adapters' names as last seen: models a request may name beside the served one
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


def _names(body: Any, fields: tuple[str, ...]) -> list[str]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise bad_field(unknown[0], f"unrecognized field(s): {', '.join(map(repr, unknown))}")
    values = [body.get(name) for name in fields]
    if not all(isinstance(value, str) and value for value in values):
        raise bad_field(fields[0], f"{' and '.join(repr(f) for f in fields)} must be given as non-empty strings")
    return values


async def update(app: web.Application, link: FrontendLink, served: str, body: Any, load: bool) -> web.Response:
    """Load (``load``) or unload the adapter the body names; the plain-text success or the
    error object with its status (module docstring)."""
    if load:
        name, path = _names(body, ("lora_name", "lora_path"))
        if name == served:
            raise bad_field("lora_name", f"'{name}' is the served model's name; give the adapter another")
    else:
        (name,), path = _names(body, ("lora_name",)), None
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
        raise ApiError(status, str(exc), param="lora_name", code=exc.code) from None
    except Exception as exc:
        raise api_error(exc) from None
    await refresh_loras(app, link)
    done = f"loaded from {path}" if load else "unloaded"
    return web.Response(text=f"Success: LoRA adapter '{name}' {done}.", content_type="text/plain")
