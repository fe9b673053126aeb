"""The client protocol's command maps (docs/protocol.md): what a client sends for ``stats``,
``profile``, ``metrics``, ``load_lora`` / ``unload_lora``, ``tokenize`` and ``detokenize``, and an
RL trainer's ``update_weights``, ``sleep``, ``wake_up``, ``pause``, ``resume``, ``engine_state``."""

from __future__ import annotations

import uuid
from typing import Any

from conveyor.protocol import wire


def profile_message(window_s: float, trace: bool, series: list[str] | None) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "type": wire.PROFILE,
        "v": wire.CLIENT_PROTOCOL_VERSION,
        "window_s": window_s,
        "trace": trace,
    }
    if series:
        msg["series"] = list(series)
    return msg


def lora_message(name: str, path: str | None) -> dict[str, Any]:
    """A ``load_lora`` of the adapter in directory ``path`` as ``name``, or (``path`` None) an ``unload_lora``."""
    msg: dict[str, Any] = {"v": wire.CLIENT_PROTOCOL_VERSION, "request_id": str(uuid.uuid4()), "lora_name": name}
    if path is None:
        msg["type"] = wire.UNLOAD_LORA
    else:
        msg.update(type=wire.LOAD_LORA, lora_path=str(path))
    return msg


def stats_message(iterations: bool) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": wire.STATS, "v": wire.CLIENT_PROTOCOL_VERSION}
    if iterations:
        msg["iterations"] = True
    return msg


def metrics_message() -> dict[str, Any]:
    return {"type": wire.METRICS, "v": wire.CLIENT_PROTOCOL_VERSION}


def tokenize_message(prompt: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    """A ``tokenize`` of ``prompt`` (or of the input in ``fields``), answered under its fresh id."""
    msg: dict[str, Any] = {"type": wire.TOKENIZE, "v": wire.CLIENT_PROTOCOL_VERSION, "request_id": str(uuid.uuid4())}
    if prompt is not None:
        msg["prompt"] = prompt
    msg.update({k: v for k, v in fields.items() if v is not None})
    return msg


def detokenize_message(token_ids: list[int]) -> dict[str, Any]:
    return {
        "type": wire.DETOKENIZE,
        "v": wire.CLIENT_PROTOCOL_VERSION,
        "request_id": str(uuid.uuid4()),
        "token_ids": list(token_ids),
    }


def rl_message(kind: str, **fields: Any) -> dict[str, Any]:
    """An RL trainer's command (:mod:`conveyor.protocol.rl_commands`), the fields that are not
    None, answered under its fresh id."""
    msg: dict[str, Any] = {"type": kind, "v": wire.CLIENT_PROTOCOL_VERSION, "request_id": str(uuid.uuid4())}
    msg.update({k: v for k, v in fields.items() if v is not None})
    return msg


def weight_group(
    address: str, rank_offset: int, world_size: int, specs: list[tuple[str, str, list[int]]], timeout_s: float = 300.0
) -> dict[str, Any]:
    """The ``group`` of an ``update_weights`` from a trainer's torch.distributed group hosted
    at ``address`` (``host:port``) by its rank 0; the server's rank r joins as ``rank_offset
    + r``; ``specs``: (name, dtype name, shape) of each tensor, in the order they are broadcast."""
    return {
        "address": address,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "names": [name for name, _, _ in specs],
        "dtypes": [dtype for _, dtype, _ in specs],
        "shapes": [list(shape) for _, _, shape in specs],
        "timeout_s": timeout_s,
    }
