"""An RL trainer's routes (docs/rl.md): vLLM's ``POST /sleep?level=``, ``POST /wake_up``, ``GET
/is_sleeping``, ``POST /pause?mode=``, ``POST /resume``, ``GET /is_paused``; SGLang's ``POST
/update_weights_from_disk``, ``POST /update_weights_from_distributed`` (one call: the group's
address and the tensors' specs together), ``POST /pause_generation``, ``POST
/continue_generation`` and ``GET /get_weight_version``.

They are clients of the frontend's commands (:mod:`conveyor.protocol.rl_commands`), guarded as
the adapter routes are: an API key when the server has keys (the app's middleware), and the
frontend refuses every one but the state queries unless bin/serve runs with
--enable-rl-control (a 404 here, as vLLM leaves its dev routes out). Statuses: 400 for a bad
field or an update that does not fit the model, 404 for a checkpoint that is not there, 409
for a command that cannot apply now (an update while asleep, a pause holding requests that
cannot finish).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from conveyor.client import ServerError
from conveyor.client.commands import weight_group
from conveyor.http.errors import ApiError, bad_field
from conveyor.http.json_body import decode_body
from conveyor.http.link import api_error
from conveyor.http.openai_responses import json_encode
from conveyor.protocol import rl_commands, wire

_STATUS_OF_CODE = {
    wire.INVALID_FIELD: 400,
    rl_commands.WEIGHTS_INVALID: 400,
    rl_commands.RL_CONTROL_DISABLED: 404,
    rl_commands.WEIGHTS_NOT_FOUND: 404,
    rl_commands.CONTROL_INVALID: 409,
}
IN_FLIGHT = ("finish", "abort")
PAUSE_MODES = ("abort", "wait", "keep")
DISK_FIELDS = frozenset({"model_path", "in_flight", "load_format", "abort_all_requests"})
GROUP_FIELDS = frozenset(
    {"master_address", "master_port", "rank_offset", "world_size", "names", "dtypes", "shapes", "in_flight"}
    | {"timeout_s", "group_name", "backend", "abort_all_requests"}
)


def _json(obj: Any) -> web.Response:
    return web.Response(body=json_encode(obj), content_type="application/json")


async def _call(link, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The frontend's ``engine`` reply to the command, or its refusal as the HTTP error."""
    await link.require_started()
    try:
        return await getattr(link.client, method)(*args, **kwargs)
    except ServerError as exc:
        status = _STATUS_OF_CODE.get(exc.code)
        if status is None:
            raise api_error(exc) from None
        raise ApiError(status, str(exc), code=exc.code) from None
    except Exception as exc:
        raise api_error(exc) from None


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` of field ``name`` when it is one of ``choices`` (a 400 naming it otherwise)."""
    if value not in choices:
        raise bad_field(name, f"{name!r} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _query(request: web.Request, name: str, choices: tuple[str, ...], default: str) -> str:
    return _choice(name, request.query.get(name, default), choices)


def _accepted(body: dict[str, Any], name: str, values: tuple[Any, ...]) -> None:
    """SGLang's fields Conveyor takes only at their default (a 400 naming them otherwise)."""
    if body.get(name) not in values:
        raise bad_field(name, f"{name!r} may only be {' or '.join(map(repr, values))} here, got {body[name]!r}")


def _in_flight(body: dict[str, Any]) -> str:
    """``in_flight`` (finish / abort), or SGLang's ``abort_all_requests`` true for abort."""
    if body.get("abort_all_requests") is True:
        return "abort"
    return _choice("in_flight", body.get("in_flight", "finish"), IN_FLIGHT)


async def _object(request: web.Request, fields: frozenset[str]) -> dict[str, Any]:
    body = decode_body(await request.read())
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_field(unknown[0], f"unrecognized field(s): {', '.join(map(repr, unknown))}")
    return body


def _updated(reply: dict[str, Any], what: str) -> web.Response:
    return _json(
        {"success": True, "message": f"weights updated from {what}", "weight_version": reply["weight_version"]}
    )


def routes(link_key: web.AppKey) -> web.RouteTableDef:
    """The routes, reaching the frontend through the app's ``link_key``."""
    table = web.RouteTableDef()

    @table.post("/sleep")
    async def sleep(request: web.Request) -> web.Response:
        level = _query(request, "level", ("1", "2"), "1")
        in_flight = _query(request, "in_flight", IN_FLIGHT, "finish")
        return _json(await _call(request.app[link_key], "sleep", int(level), in_flight=in_flight))

    @table.post("/wake_up")
    async def wake_up(request: web.Request) -> web.Response:
        return _json(await _call(request.app[link_key], "wake_up"))

    @table.get("/is_sleeping")
    async def is_sleeping(request: web.Request) -> web.Response:
        return _json({"is_sleeping": (await _call(request.app[link_key], "engine_state"))["is_sleeping"]})

    async def pause(request: web.Request, mode: str) -> web.Response:
        return _json(await _call(request.app[link_key], "pause", mode))

    @table.post("/pause")
    async def vllm_pause(request: web.Request) -> web.Response:
        return await pause(request, _query(request, "mode", PAUSE_MODES, "abort"))

    @table.post("/pause_generation")
    async def sglang_pause(request: web.Request) -> web.Response:
        body = await _object(request, frozenset({"mode"})) if request.body_exists else {}
        return await pause(request, _choice("mode", body.get("mode", "abort"), PAUSE_MODES))

    @table.post("/resume")
    @table.post("/continue_generation")
    async def resume(request: web.Request) -> web.Response:
        return _json(await _call(request.app[link_key], "resume"))

    @table.get("/is_paused")
    async def is_paused(request: web.Request) -> web.Response:
        return _json({"is_paused": (await _call(request.app[link_key], "engine_state"))["is_paused"]})

    @table.get("/get_weight_version")
    async def weight_version(request: web.Request) -> web.Response:
        return _json({"weight_version": (await _call(request.app[link_key], "engine_state"))["weight_version"]})

    @table.post("/update_weights_from_disk")
    async def from_disk(request: web.Request) -> web.Response:
        body = await _object(request, DISK_FIELDS)
        _accepted(body, "load_format", (None, "auto"))
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise bad_field("model_path", "'model_path' is required: the checkpoint directory on the server's host")
        reply = await _call(request.app[link_key], "update_weights", path, in_flight=_in_flight(body))
        return _updated(reply, path)

    @table.post("/update_weights_from_distributed")
    async def from_group(request: web.Request) -> web.Response:
        body = await _object(request, GROUP_FIELDS)
        _accepted(body, "backend", (None, "gloo"))  # (the group is gloo's: tensors travel through host memory)
        for name in ("master_address", "master_port", "rank_offset", "world_size", "names", "dtypes", "shapes"):
            if name not in body:
                raise bad_field(name, f"{name!r} is required")
        specs = list(zip(body["names"], body["dtypes"], body["shapes"])) if _lists(body) else []
        if not specs:
            raise bad_field("names", "'names', 'dtypes' and 'shapes' must be non-empty lists of the same length")
        group = weight_group(
            f"{body['master_address']}:{body['master_port']}",
            body["rank_offset"],
            body["world_size"],
            specs,
            body.get("timeout_s", 300.0),
        )
        reply = await _call(request.app[link_key], "update_weights", group=group, in_flight=_in_flight(body))
        return _updated(reply, f"the group at {group['address']}")

    return table


def _lists(body: dict[str, Any]) -> bool:
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    return all(isinstance(x, list) for x in (names, dtypes, shapes)) and len(names) == len(dtypes) == len(shapes)
