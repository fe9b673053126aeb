"""The worker's CPU thread policy (conveyor.worker.cpu_threads): how many threads, how they wait."""

from __future__ import annotations

import os

import pytest

from conveyor.worker import cpu_threads


@pytest.mark.parametrize(
    ("cores", "ranks", "expected"), [(2, 1, 1), (16, 1, 15), (17, 4, 4), (2, 4, 1), (1, 1, 1), (8, 2, 3)]
)
def test_threads_are_the_usable_cores_but_one_shared_by_the_ranks(monkeypatch, cores, ranks, expected) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert cpu_threads.worker_threads(None, ranks) == expected


def test_threads_asked_for_win(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_threads.worker_threads(5, 1) == 5


def test_usable_cores_follow_the_affinity_not_the_machine(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert cpu_threads.usable_cores() == 1


def test_passive_unless_the_environment_chose(monkeypatch) -> None:
    monkeypatch.delenv(cpu_threads.WAIT_POLICY, raising=False)
    assert cpu_threads.passive_waits() == "PASSIVE"
    assert os.environ[cpu_threads.WAIT_POLICY] == "PASSIVE"
    monkeypatch.setenv(cpu_threads.WAIT_POLICY, "ACTIVE")
    assert cpu_threads.passive_waits() == "ACTIVE"
