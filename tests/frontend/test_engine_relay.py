"""An RL trainer's commands at the frontend: parsed field by field (one error naming the field),
refused unless bin/serve runs with --enable-rl-control (the state query always answered),
relayed to every replica and answered with the first refusal or the merged state."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.frontend.engine_relay import EngineRelay
from conveyor.ipc.messages import EngineControlled, EngineStateQuery, UpdateWeights
from conveyor.protocol import wire
from conveyor.protocol.requests import parse_client_message


class Sender:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send(self, identity: bytes, reply: dict) -> None:
        self.sent.append(reply)


class Replicas:
    def __init__(self) -> None:
        self.sent: list = []

    def broadcast(self, msg) -> set[int]:
        self.sent.append(msg)
        return {0, 1}


def command(kind: str, **fields):
    return parse_client_message({"type": kind, "v": 1, "request_id": "r1", **fields})


@pytest.mark.parametrize(
    "kind, fields, field",
    [
        ("sleep", {"level": 3}, "'level'"),
        ("pause", {"mode": "later"}, "'mode'"),
        ("update_weights", {}, "exactly one of 'path'"),
        ("update_weights", {"path": "/a", "group": {}}, "exactly one of 'path'"),
        ("update_weights", {"path": "/a", "in_flight": "never"}, "'in_flight'"),
        ("update_weights", {"group": {"address": "nohost"}}, "'group.address'"),
        ("wake_up", {"level": 1}, "unknown field"),
    ],
)
def test_bad_commands_name_the_field(kind: str, fields: dict, field: str) -> None:
    with pytest.raises(wire.ProtocolError, match=field):
        command(kind, **fields)


def test_off_unless_enabled_and_answers_merged() -> None:
    async def main():
        sender, replicas = Sender(), Replicas()
        off = EngineRelay(replicas, sender, enabled=False)
        await off.relay(b"c", command("update_weights", path="/ckpt"))
        assert sender.sent[-1]["code"] == "rl_control_disabled" and "--enable-rl-control" in sender.sent[-1]["message"]
        await off.relay(b"c", command("engine_state"))
        assert isinstance(replicas.sent[-1], EngineStateQuery)

        relay = EngineRelay(replicas, sender, enabled=True)
        await relay.relay(b"c", command("update_weights", path="/ckpt", in_flight="abort"))
        msg = replicas.sent[-1]
        assert isinstance(msg, UpdateWeights) and msg.path == "/ckpt" and msg.in_flight == "abort"
        await relay.on_answer(0, EngineControlled(msg.query_id, weight_version=3))
        await relay.on_answer(1, EngineControlled(msg.query_id, "invalid_weights", "missing weights: x"))
        assert sender.sent[-1]["code"] == "invalid_weights" and sender.sent[-1]["request_id"] == "r1"

        await relay.relay(b"c", command("sleep", level=2))
        query_id = replicas.sent[-1].query_id
        await relay.on_answer(0, EngineControlled(query_id, weight_version=3, sleep_level=2, freed_bytes=5))
        await relay.replica_gone(1)
        reply = sender.sent[-1]
        assert reply["type"] == "engine" and reply["is_sleeping"] and reply["freed_bytes"] == 5

    asyncio.run(main())
