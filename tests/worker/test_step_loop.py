"""The worker's step loop (worker/main.py StepLoop) with a scripted runner and channels.

What matters is the order of launches, finishes and results: pipelined, the next plan is
launched before the earlier step is finished, results still leave in step order, and a
failure (at launch or at finish) fails that step alone: failing the plan planned ahead of it
is the runner's rule (tests/worker/test_model_runner.py). No torch: the runner is a stand-in
that records its calls.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest

from conveyor import profiling
from conveyor.ipc.messages import NewRequestData, SamplingParams, Shutdown, StepPlan, StepResult
from conveyor.ipc.step_channel import PeerGone
from conveyor.worker.main import StepLoop, resolve_pipeline
from tests import plans


class ScriptedRunner:
    def __init__(self, fail_launch=(), fail_finish=()) -> None:
        self.calls: list[str] = []
        self.fail_launch, self.fail_finish = set(fail_launch), set(fail_finish)
        self.adapters = self  # (its LoRA side: LoraRunner scripts one)

    def launch(self, plan: StepPlan):
        self.calls.append(f"launch {plan.step_id}")
        if plan.step_id in self.fail_launch:
            raise ValueError(f"bad plan {plan.step_id}")
        return plan

    def step_done(self, launched) -> bool:
        return True  # (asked only when no plan is waiting: every plan is there from the start)

    def finish(self, launched) -> StepResult:
        self.calls.append(f"finish {launched.step_id}")
        if launched.step_id in self.fail_finish:
            raise RuntimeError("device error")
        return StepResult(launched.step_id, [0], [launched.step_id])


class ScriptedPlans:
    """Every message is there from the start; once they are consumed, the scheduler is gone."""

    def __init__(self, messages) -> None:
        self.messages = deque(messages)

    def ready(self) -> bool:
        return bool(self.messages)

    def wait(self, timeout=None) -> bool:
        if not self.messages:
            raise PeerGone("no more plans")
        return True

    def recv(self, timeout=None):
        return self.messages.popleft()


class Results:
    def __init__(self) -> None:
        self.sent: list[StepResult] = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def plan(step: int, ahead: bool = True) -> StepPlan:
    return plans.plan(step, planned_ahead=ahead)


def run(messages, pipeline: bool, **failures):
    runner, results = ScriptedRunner(**failures), Results()
    StepLoop(runner, ScriptedPlans(messages), results, profiling.Profiler("worker", enabled=False), pipeline).run()
    return runner.calls, [(r.step_id, r.error is None) for r in results.sent]


def test_pipelined_loop_launches_the_next_step_before_finishing_the_last():
    calls, sent = run([plan(1, False), plan(2), plan(3)], pipeline=True)
    assert calls == ["launch 1", "launch 2", "finish 1", "launch 3", "finish 2", "finish 3"]
    assert sent == [(1, True), (2, True), (3, True)]


def test_plain_loop_finishes_each_step_before_the_next():
    calls, sent = run([plan(1, False), plan(2), plan(3)], pipeline=False)
    assert calls == ["launch 1", "finish 1", "launch 2", "finish 2", "launch 3", "finish 3"]
    assert sent == [(1, True), (2, True), (3, True)]


def test_failed_launch_reports_after_the_step_before_it():
    calls, sent = run([plan(1, False), plan(2), plan(3), plan(4, False)], pipeline=True, fail_launch={2})
    assert calls == ["launch 1", "launch 2", "finish 1", "launch 3", "finish 3", "launch 4", "finish 4"]
    # 2's error is sent after 1's result; the others are what the runner returned.
    assert sent == [(1, True), (2, False), (3, True), (4, True)]


def test_failed_finish_is_sent_in_step_order():
    calls, sent = run([plan(1, False), plan(2), plan(3, False)], pipeline=True, fail_finish={1})
    assert calls == ["launch 1", "launch 2", "finish 1", "finish 2", "launch 3", "finish 3"]
    assert sent == [(1, False), (2, True), (3, True)]


def test_a_plan_not_planned_ahead_waits_for_the_step_before_to_finish():
    """A tensor-parallel rank > 0 sends no results: the scheduler's next plan (formed on rank
    0's result) can be waiting before this rank saw its step done. Launched first, it was
    checked against state the step's finish had yet to change (a speculative step's rejected
    tokens), and refused on this rank alone while rank 0 ran it: the group hung."""
    runner, messages = ScriptedRunner(), ScriptedPlans([plan(1, False), plan(2, False), plan(3), plan(4, False)])
    runner.step_done = lambda launched: not messages.ready()  # the next plan is always there first
    loop = StepLoop(runner, messages, None, profiling.Profiler("worker", enabled=False), pipeline=True)
    loop.run()
    assert runner.calls == [
        "launch 1",
        "finish 1",
        "launch 2",
        "launch 3",
        "finish 2",
        "finish 3",
        "launch 4",
        "finish 4",
    ]


def test_shutdown_finishes_the_launched_step_first():
    calls, sent = run([plan(1, False), Shutdown("bye"), plan(2)], pipeline=True)
    assert calls == ["launch 1", "finish 1"]
    assert sent == [(1, True)]


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [
        ("auto", "cuda", True),
        ("auto", "cuda:1", True),
        ("auto", "cpu", False),
        ("on", "cpu", True),
        ("off", "cuda", False),
    ],
)
def test_pipeline_setting(setting, device, expected):
    assert resolve_pipeline(setting, device) is expected
    with pytest.raises(ValueError):
        resolve_pipeline("sometimes", device)


def test_the_worker_config_holds_its_runners_config(tmp_path):
    """The worker's view nests the runner's config instead of mirroring its fields:
    worker_config puts every setting named as a RunnerConfig field into it and the process's
    settings beside it, and the two share no field name (nothing is copied by name)."""
    import dataclasses

    from conveyor.assembly.build import worker_config
    from conveyor.ipc.step_channel import StepChannels
    from conveyor.ipc.transport import ServerAddresses
    from conveyor.runtime.config import RunnerConfig, WorkerConfig

    addresses = ServerAddresses.in_run_dir(str(tmp_path), "tcp://127.0.0.1:1")
    channels = StepChannels.for_server(str(tmp_path), addresses.plans, addresses.results, shm=False)
    settings = dict(
        block_size=8, num_blocks=40, max_num_seqs=7, enforce_eager=True, first_device=2, profile=False, port=1
    )
    worker = worker_config(settings, model_dir="m", addresses=addresses, channels=channels, pipeline="off")
    assert worker.runner == RunnerConfig(
        "m", block_size=8, num_blocks=40, max_num_seqs=7, enforce_eager=True, first_device=2
    )  # fmt: skip
    assert (worker.profile, worker.pipeline, worker.channels) == (False, "off", channels)
    assert not {f.name for f in dataclasses.fields(WorkerConfig)} & {f.name for f in dataclasses.fields(RunnerConfig)}
    with pytest.raises(ValueError, match="device must be one of"):
        worker_config(settings, model_dir="m", addresses=addresses, channels=channels, device="tpu")
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        worker_config(settings, model_dir="m", addresses=addresses, channels=channels, num_blocks=0)


@pytest.mark.parametrize("pipeline", [True, False])
def test_profiling_loop_records_each_good_steps_shape_in_step_order(pipeline):
    """One step record per step that succeeded (the failed one has none), each with its own
    plan's shape even when the next plan was launched before it finished."""
    shaped = [
        plans.plan(
            s, [NewRequestData(f"r{s}", s, list(range(3 * s)), SamplingParams(), [0], 0, 3 * s)], planned_ahead=s > 1
        )
        for s in (1, 2, 3)
    ]
    prof = profiling.Profiler("worker")
    StepLoop(ScriptedRunner(fail_finish={2}), ScriptedPlans(shaped), Results(), prof, pipeline).run()
    series = {s.name: s.values for s in prof.snapshot(3600, series=list(profiling.STEP_SERIES)).series}
    assert series["step_prefill_tokens"] == [3, 9] and series["step_context_tokens"] == [3, 9]
    assert len(series["step_time"]) == 2 and all(t >= 0 for t in series["step_time"])


class LoraRunner(ScriptedRunner):
    """A runner whose adapter reads wait for ``release`` (a slow read of big files)."""

    def __init__(self, release, fail: bool = False) -> None:
        super().__init__()
        self.release, self.fail = release, fail

    def read_lora(self, name: str, path: str):
        from conveyor.worker.lora import LoraFilesMissing

        assert self.release.wait(10)
        self.calls.append(f"read {name}")
        if self.fail:
            raise LoraFilesMissing(f"adapter {name!r}: missing file {path}/adapter_config.json")
        return name

    def add_lora(self, name: str, path: str, read) -> None:
        self.calls.append(f"add {read()}")

    def unload_lora(self, name: str) -> None:
        self.calls.append(f"unload {name}")


class ScheduledPlans(ScriptedPlans):
    """As ScriptedPlans, and when they run out with a read in flight (the loop waits with a
    timeout), the read is let go; once the loop reported it (LoraRead), the commit comes."""

    def __init__(self, messages, release, results) -> None:
        super().__init__(messages)
        self.release, self.results, self.committed = release, results, False

    def wait(self, timeout=None) -> bool:
        from conveyor.ipc.messages import CommitLora, LoraRead

        if self.messages or timeout is None:
            return super().wait(timeout)
        self.release.set()
        reported = [m for m in self.results.sent if isinstance(m, LoraRead)]
        if reported and not self.committed:
            self.committed = True
            self.messages.append(CommitLora(reported[0].query_id))
            return True
        time.sleep(timeout)
        return False


@pytest.mark.parametrize("fail", [False, True])
@pytest.mark.parametrize("pipeline", [False, True])
def test_an_adapter_is_read_while_steps_run(pipeline: bool, fail: bool) -> None:
    from conveyor.ipc.messages import LoadLora, LoraUpdated, UnloadLora

    release, results = threading.Event(), Results()
    runner = LoraRunner(release, fail)
    messages = [LoadLora("q", "sql", "/adapters/sql"), plan(1, False), plan(2), UnloadLora("u", "old")]
    loop = StepLoop(
        runner,
        ScheduledPlans(messages, release, results),
        results,
        profiling.Profiler("worker", enabled=False),
        pipeline,
    )
    loop.run()
    loop.reads.close()
    # The steps ran while the read waited (an unload between them, pipelined while step 2 runs);
    # the adapter was registered on the commit alone.
    steps = (
        ["launch 1", "launch 2", "finish 1", "unload old", "finish 2"]
        if pipeline
        else ["launch 1", "finish 1", "launch 2", "finish 2", "unload old"]
    )
    assert runner.calls == [*steps, "read sql", *([] if fail else ["add sql"])]
    assert [type(m).__name__ for m in results.sent] == ["StepResult", "StepResult", "LoraRead", "LoraUpdated"]
    answer = results.sent[-1]
    assert isinstance(answer, LoraUpdated) and answer.query_id == "q" and answer.name == "sql"
    assert (answer.code, answer.error is None) == (("lora_not_found", False) if fail else ("ok", True))
