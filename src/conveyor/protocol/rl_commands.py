"""The client messages an RL trainer drives the server with (docs/protocol.md, docs/rl.md):
``update_weights``, ``sleep``, ``wake_up``, ``pause``, ``resume`` and ``engine_state``, each
answered under its ``request_id`` by an ``engine`` map (the server's state after it) or an
``error`` map. Every one but ``engine_state`` needs bin/serve --enable-rl-control."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.ipc.messages.engine_control import IN_FLIGHT_MODES, PAUSE_MODES, WeightGroup, WeightSpecs
from conveyor.protocol.limits import MAX_REQUEST_ID_LEN
from conveyor.protocol.validation import is_int, is_number
from conveyor.protocol.wire import CLIENT_PROTOCOL_VERSION, CommandError

UPDATE_WEIGHTS = "update_weights"
SLEEP = "sleep"
WAKE_UP = "wake_up"
PAUSE = "pause"
RESUME = "resume"
ENGINE_STATE = "engine_state"
ENGINE_REPLY = "engine"
# Error codes of these commands (beside invalid_field): the server runs without
# --enable-rl-control; the command cannot apply now; the weights do not fit; not there.
RL_CONTROL_DISABLED = "rl_control_disabled"
CONTROL_INVALID = "invalid_control"
WEIGHTS_INVALID = "invalid_weights"
WEIGHTS_NOT_FOUND = "weights_not_found"

_COMMON = frozenset({"type", "v", "request_id"})
RL_FIELDS = {
    UPDATE_WEIGHTS: _COMMON | {"path", "group", "in_flight"},
    SLEEP: _COMMON | {"level", "in_flight"},
    WAKE_UP: _COMMON,
    PAUSE: _COMMON | {"mode"},
    RESUME: _COMMON,
    ENGINE_STATE: _COMMON,
}
GROUP_FIELDS = frozenset({"address", "rank_offset", "world_size", "names", "dtypes", "shapes", "timeout_s"})
MAX_PATH_LEN = 4096
MAX_WEIGHTS = 1 << 16


@dataclass
class EngineCommand:
    """One of :data:`RL_FIELDS`' commands (``kind``) with its fields (defaults where absent)."""

    request_id: str
    kind: str
    path: str | None = None
    group: WeightGroup | None = None
    in_flight: str = "finish"
    level: int = 1
    mode: str = "abort"


def parse_rl_command(obj: dict[str, Any], kind: str) -> EngineCommand:
    """The command of the map ``obj`` of type ``kind``; CommandError naming the field at fault."""
    unknown = set(obj) - RL_FIELDS[kind]
    rid = obj.get("request_id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_LEN:
        raise CommandError(f"{kind} needs 'request_id': a non-empty string of at most {MAX_REQUEST_ID_LEN} characters")
    if unknown:
        raise CommandError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}", rid)
    cmd = EngineCommand(rid, kind)
    in_flight = obj.get("in_flight", "finish")
    if in_flight not in IN_FLIGHT_MODES:
        raise CommandError(f"'in_flight' must be one of {', '.join(IN_FLIGHT_MODES)}, got {in_flight!r}", rid)
    cmd.in_flight = in_flight
    if kind == SLEEP:
        level = obj.get("level", 1)
        if not is_int(level) or level not in (1, 2):
            raise CommandError(f"'level' must be 1 (the KV cache) or 2 (the weights too), got {level!r}", rid)
        cmd.level = level
    elif kind == PAUSE:
        mode = obj.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise CommandError(f"'mode' must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", rid)
        cmd.mode = mode
    elif kind == UPDATE_WEIGHTS:
        path, group = obj.get("path"), obj.get("group")
        if (path is None) == (group is None):
            raise CommandError("update_weights needs exactly one of 'path' (a checkpoint directory) or 'group'", rid)
        if path is not None:
            if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_LEN:
                raise CommandError(f"'path' must be a directory: a non-empty string of at most {MAX_PATH_LEN}", rid)
            cmd.path = path
        else:
            cmd.group = _parse_group(group, rid)
    return cmd


def _parse_group(group: Any, rid: str) -> WeightGroup:
    if not isinstance(group, dict):
        raise CommandError("'group' must be a map of " + ", ".join(sorted(GROUP_FIELDS)), rid)
    unknown = set(group) - GROUP_FIELDS
    if unknown:
        raise CommandError(f"unknown field(s) of 'group': {', '.join(sorted(map(str, unknown)))}", rid)
    address = group.get("address")
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit():
        raise CommandError(f"'group.address' must be host:port (the trainer's rank 0), got {address!r}", rid)
    offset, world = group.get("rank_offset"), group.get("world_size")
    if not is_int(offset) or not is_int(world) or not 1 <= offset < world:
        raise CommandError(
            "'group.rank_offset' and 'group.world_size' must be integers, 1 <= rank_offset < world_size", rid
        )
    names, dtypes, shapes = group.get("names"), group.get("dtypes"), group.get("shapes")
    lists = (names, dtypes, shapes)
    if not all(isinstance(x, list) for x in lists) or not 0 < len(names) == len(dtypes) == len(shapes) <= MAX_WEIGHTS:
        raise CommandError("'group.names', 'group.dtypes' and 'group.shapes' must be lists of the same length", rid)
    if not all(isinstance(n, str) for n in names) or not all(isinstance(d, str) for d in dtypes):
        raise CommandError("'group.names' and 'group.dtypes' must hold strings", rid)
    if not all(isinstance(s, list) and all(is_int(d) and d >= 0 for d in s) for s in shapes):
        raise CommandError("'group.shapes' must hold lists of non-negative integers", rid)
    timeout = group.get("timeout_s", 300.0)
    if not is_number(timeout) or timeout <= 0:
        raise CommandError(f"'group.timeout_s' must be a positive number, got {timeout!r}", rid)
    return WeightGroup(address, offset, world, WeightSpecs(names, dtypes, shapes), float(timeout))


def engine_reply(request_id: str, kind: str, answer: Any) -> dict[str, Any]:
    """The ``engine`` map answering ``kind``: the state after it (``answer``: the replicas'
    :class:`~conveyor.ipc.messages.EngineControlled`, merged)."""
    return {
        "type": ENGINE_REPLY,
        "v": CLIENT_PROTOCOL_VERSION,
        "request_id": request_id,
        "command": kind,
        "weight_version": answer.weight_version,
        "is_sleeping": answer.sleep_level > 0,
        "sleep_level": answer.sleep_level,
        "is_paused": answer.paused,
        "freed_bytes": answer.freed_bytes,
    }
