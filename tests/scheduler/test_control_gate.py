"""The scheduler's side of an RL trainer's commands (conveyor.scheduler.control_gate): an
update waits for what runs (or aborts it with the reason), holds requests that arrive until the
worker answers, then bumps the version and drops the prefix cache; while asleep requests wait
or are refused as configured; pause modes; commands that cannot apply are refused with why."""

from __future__ import annotations

import time

import pytest

from conveyor.ipc.messages import (
    AddRequest,
    ContinueGeneration,
    EngineControlled,
    PauseGeneration,
    SamplingParams,
    SleepEngine,
    UpdateWeights,
    WakeEngine,
)
from conveyor.scheduler.control_gate import ControlGate
from conveyor.scheduler.scheduler import Scheduler
from tests.scheduler.scenario_helpers import cfg


def request(rid: str) -> AddRequest:
    return AddRequest(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), time.time())


def gate(asleep_requests: str = "wait") -> ControlGate:
    return ControlGate(Scheduler(cfg(), [0], 1000), asleep_requests)


def test_an_update_waits_for_what_runs_and_holds_new_requests() -> None:
    g = gate()
    assert g.admit(request("a")) is None and g.scheduler.has_work()
    answer, aborted = g.receive(UpdateWeights("q1", path="/ckpt"))
    assert answer is None and aborted == []
    assert g.next_command(idle=False) == (None, None)  # what runs first finishes
    assert g.admit(request("b")) is None and "b" not in g.scheduler.state.table.live  # held
    command, _ = g.next_command(idle=True)
    assert isinstance(command, UpdateWeights) and g.release() == []
    g.admit(request("c"))  # held too, then aborted by its client: never run
    g.forget(["c"])
    answer = g.worker_answered(EngineControlled("q1"))
    assert answer.ok and answer.weight_version == 1
    assert [m.request_id for m in g.release()] == ["b"]


def test_an_abort_update_aborts_with_the_reason_and_a_refusal_changes_nothing() -> None:
    g = gate()
    g.admit(request("a"))
    answer, aborted = g.receive(UpdateWeights("q1", in_flight="abort", path="/ckpt"))
    assert [o.finish_reason for o in aborted] == ["abort"] and aborted[0].error == "aborted: weights updated"
    command, _ = g.next_command(idle=True)
    answer = g.worker_answered(EngineControlled("q1", "invalid_weights", "missing weights: x"))
    assert not answer.ok and answer.weight_version == 0 and answer.error == "missing weights: x"


@pytest.mark.parametrize("policy", ["wait", "refuse"])
def test_requests_while_asleep_wait_or_are_refused(policy: str) -> None:
    g = gate(policy)
    g.receive(SleepEngine("s", level=2))
    g.next_command(idle=True)
    assert g.worker_answered(EngineControlled("s", freed_bytes=10)).sleep_level == 2
    refused = g.admit(request("a"))
    if policy == "refuse":
        assert refused.finish_reason == "error" and "asleep" in refused.error
    else:
        assert refused is None and g.held
    answer, _ = g.receive(UpdateWeights("u", path="/ckpt"))
    assert answer.code == "invalid_control" and "wake_up first" in answer.error
    g.receive(WakeEngine("w"))
    command, _ = g.next_command(idle=True)
    assert isinstance(command, WakeEngine)
    answer = g.worker_answered(EngineControlled("w"))
    assert answer.sleep_level == 0 and answer.weight_version == 1  # level 2 read the checkpoint again
    assert len(g.release()) == (policy == "wait")


def test_pause_modes() -> None:
    g = gate()
    g.admit(request("a"))
    answer, aborted = g.receive(PauseGeneration("p", "keep"))
    assert answer.paused and aborted == [] and g.scheduler.has_work()
    answer, _ = g.receive(UpdateWeights("u", path="/ckpt"))  # "a" cannot finish while paused
    assert answer.code == "invalid_control" and "continue_generation first" in answer.error
    assert not g.receive(ContinueGeneration("c"))[0].paused
    answer, _ = g.receive(PauseGeneration("w", "wait"))
    assert answer is None  # answered once the loop finds nothing in flight
    assert g.next_command(idle=True)[1].paused
    answer, aborted = g.receive(PauseGeneration("p2", "abort"))
    assert answer.paused and [o.error for o in aborted] == ["aborted: generation paused"]
