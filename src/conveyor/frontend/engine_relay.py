"""The frontend's relay of an RL trainer's commands (``update_weights``, ``sleep``, ``wake_up``,
``pause``, ``resume``, ``engine_state``; :mod:`conveyor.protocol.rl_commands`) to every live
replica's scheduler, answered once each answered or died: the first refusal, or the state
after it (docs/rl.md). Refused here unless bin/serve runs with --enable-rl-control
(``engine_state`` only reads, and is always answered)."""

from __future__ import annotations

import uuid

from conveyor.frontend.replicas import Gather, ReplicaSet
from conveyor.frontend.sending import ClientSender
from conveyor.ipc.messages import (
    ContinueGeneration,
    EngineControlled,
    EngineStateQuery,
    PauseGeneration,
    SleepEngine,
    UpdateWeights,
    WakeEngine,
)
from conveyor.protocol import replies, rl_commands, wire
from conveyor.protocol.rl_commands import EngineCommand


def control_message(cmd: EngineCommand, query_id: str):
    """The scheduler's message of a client's command."""
    kind = cmd.kind
    if kind == rl_commands.UPDATE_WEIGHTS:
        return UpdateWeights(query_id, cmd.in_flight, cmd.path, cmd.group)
    if kind == rl_commands.SLEEP:
        return SleepEngine(query_id, cmd.level, cmd.in_flight)
    if kind == rl_commands.WAKE_UP:
        return WakeEngine(query_id)
    if kind == rl_commands.PAUSE:
        return PauseGeneration(query_id, cmd.mode)
    if kind == rl_commands.RESUME:
        return ContinueGeneration(query_id)
    return EngineStateQuery(query_id)


class EngineRelay:
    """The commands waiting for the replicas' answers: query id -> (client, command, answers)."""

    def __init__(self, replicas: ReplicaSet, sender: ClientSender, enabled: bool) -> None:
        self.replicas, self.sender, self.enabled = replicas, sender, enabled
        self.waiters: dict[str, tuple[bytes, EngineCommand, Gather[EngineControlled]]] = {}

    async def relay(self, identity: bytes, cmd: EngineCommand) -> None:
        if cmd.kind != rl_commands.ENGINE_STATE and not self.enabled:
            message = f"{cmd.kind} is off: start bin/serve with --enable-rl-control"
            await self.sender.send(
                identity, replies.error_map(cmd.request_id, message, rl_commands.RL_CONTROL_DISABLED)
            )
            return
        query_id = uuid.uuid4().hex
        asked = self.replicas.broadcast(control_message(cmd, query_id))
        self.waiters[query_id] = (identity, cmd, Gather(asked))
        if not asked:
            await self._reply(query_id)

    async def on_answer(self, replica: int, msg: EngineControlled) -> None:
        waiter = self.waiters.get(msg.query_id)
        if waiter is not None and waiter[2].add(replica, msg):
            await self._reply(msg.query_id)

    async def replica_gone(self, replica: int) -> None:
        for query_id, waiter in list(self.waiters.items()):
            if waiter[2].drop(replica):
                await self._reply(query_id)

    async def fail_all(self, reason: str) -> None:
        for query_id in list(self.waiters):
            identity, cmd, _ = self.waiters.pop(query_id)
            await self.sender.send(identity, replies.error_map(cmd.request_id, reason, wire.SERVER_ERROR))

    async def _reply(self, query_id: str) -> None:
        """The first refusal, or the replicas' state merged (freed bytes summed; asleep or
        paused if any replica is)."""
        identity, cmd, gather = self.waiters.pop(query_id)
        answers = [gather.answers[index] for index in sorted(gather.answers)]
        refused = [a for a in answers if not a.ok]
        if not answers:
            reply = replies.error_map(cmd.request_id, "no scheduler is alive to answer", wire.SERVER_ERROR)
        elif refused:
            reply = replies.error_map(cmd.request_id, refused[0].error or refused[0].code, refused[0].code)
        else:
            merged = EngineControlled(
                query_id,
                weight_version=min(a.weight_version for a in answers),
                sleep_level=max(a.sleep_level for a in answers),
                paused=any(a.paused for a in answers),
                freed_bytes=sum(a.freed_bytes for a in answers),
            )
            reply = rl_commands.engine_reply(cmd.request_id, cmd.kind, merged)
        await self.sender.send(identity, reply)
