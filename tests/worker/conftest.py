"""Shared fixtures for worker tests: tiny random checkpoints of each supported family
(built by tests/checkpoints.py, whose redrawn weights make a misplaced weight, position or
KV block change the outputs), and a scripted scheduler that drives a ModelRunner.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.ipc.messages import NewRequestData, SamplingParams
from conveyor.worker.model_runner import ModelRunner
from tests.checkpoints import CHECKPOINTS, make_checkpoint
from tests.plans import CachedRow, plan

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """``factory(name) -> (checkpoint dir, HF model)``, each built once per session."""
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def factory(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            built[name] = (directory, make_checkpoint(name, directory))
        return built[name]

    return factory


@pytest.fixture(params=sorted(CHECKPOINTS))
def checkpoint(request: pytest.FixtureRequest, checkpoint_factory) -> tuple[str, Path, torch.nn.Module]:
    """Every supported variant in turn: ``(name, dir, hf_model)``."""
    directory, model = checkpoint_factory(request.param)
    return request.param, directory, model


@pytest.fixture
def llama_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")[0]


def rewrite_config(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


# ---------------------------------------------------------------- scripted scheduler


@dataclass
class Script:
    """One request of a scripted run.

    Joins at step ``join``; its prompt (and, after a preemption, its outputs too) is fed
    ``chunk`` tokens per step (all at once if None); it finishes after ``max_new`` tokens.
    With ``preempt_after`` set, it is dropped (blocks freed) once it has that many outputs
    and resumes next step as a new request recomputing everything.
    """

    request_id: str
    prompt: list[int]
    max_new: int
    join: int = 0
    chunk: int | None = None
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    preempt_after: int | None = None
    lora: str | None = None  # the LoRA adapter it runs under
    # state kept by the driver
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    registered: bool = False
    slot: int = -1  # while registered
    done: bool = False
    preempted: bool = False


class ScriptedScheduler:
    """A minimal scheduler: feeds a :class:`ModelRunner` plans for ``scripts`` until all finish.

    Blocks come from a shuffled free list and return to it when a request leaves, so
    tables are non-contiguous and blocks are reused with stale contents. Slots likewise: the
    one given back last is given first, so a request (re)joining takes the slot of one that
    left the step before, in the plan that drops it. It asserts the runner samples exactly
    for the requests whose known tokens are all computed.
    """

    def __init__(self, runner: ModelRunner, scripts: list[Script], seed: int = 0) -> None:
        self.runner = runner
        self.scripts = scripts
        self.free = torch.randperm(runner.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.batch_sizes: list[int] = []
        self.free_slots = list(range(len(scripts) - 1, -1, -1))

    def run(self, max_steps: int = 200) -> dict[str, list[int]]:
        finished: list[int] = []
        for step in range(max_steps):
            if all(s.done for s in self.scripts):
                result = self.runner.execute(plan(step, [], [], finished))  # retire the last ones
                assert result.slots == [] and result.sampled_token_ids == []
                assert self.runner.slots == []
                return {s.request_id: s.outputs for s in self.scripts}
            new, cached, scheduled = [], [], {}
            for s in self.scripts:
                if s.done or step < s.join:
                    continue
                tokens = s.prompt + s.outputs
                remaining = len(tokens) - s.computed
                n = remaining if s.chunk is None else min(s.chunk, remaining)
                needed = -(-(s.computed + n) // self.runner.block_size)
                fresh = [self.free.pop() for _ in range(needed - len(s.blocks))]
                s.blocks += fresh
                if s.registered:
                    cached.append(CachedRow(s.slot, fresh, s.computed, n))
                else:
                    s.slot = self.free_slots.pop()
                    new.append(
                        NewRequestData(
                            s.request_id, s.slot, list(tokens), s.sampling, list(s.blocks), s.computed, n, lora=s.lora
                        )
                    )
                    s.registered = True
                scheduled[s.slot] = (s, n, s.computed + n == len(tokens))
            result = self.runner.execute(plan(step, new, cached, finished))
            finished = []
            self.batch_sizes.append(len(scheduled))
            assert result.error is None
            order = [r.slot for r in new] + [r.slot for r in cached]  # the runner's order
            assert result.slots == [slot for slot in order if scheduled[slot][2]]
            sampled = dict(zip(result.slots, result.sampled_token_ids))
            for slot, (s, n, _) in scheduled.items():
                s.computed += n
                if slot in sampled:
                    s.outputs.append(sampled[slot])
                leaving = len(s.outputs) == s.max_new
                preempt = s.preempt_after is not None and not s.preempted and len(s.outputs) == s.preempt_after
                if leaving or preempt:
                    finished.append(slot)
                    self.free_slots.append(slot)
                    self.free += s.blocks
                    s.blocks, s.registered, s.computed, s.slot = [], False, 0, -1
                    s.done, s.preempted = leaving, s.preempted or preempt
        raise AssertionError("scripted run did not finish")


@pytest.fixture
def scripted() -> type[ScriptedScheduler]:
    return ScriptedScheduler


@pytest.fixture
def script() -> type[Script]:
    return Script
