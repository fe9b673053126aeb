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


@pytest.mark.parametrize(
    ("cores", "slot", "slots", "threads", "expected"),
    [
        ({0, 1}, 0, 1, 1, [0]),  # 2 cores: the worker on the first, the second left to the others
        ({4, 5, 6, 7}, 1, 2, 1, [5]),  # replicas' workers on disjoint cores, under a taskset
        ({0, 1, 2, 3, 4, 5, 6, 7}, 1, 2, 3, [3, 4, 5]),
        ({0, 1}, 1, 2, 1, [1]),  # as many threads as cores: each slot its own, none left over
        ({0, 1}, 0, 2, 2, None),  # more threads than cores: they float
        ({0}, 0, 1, 1, [0]),
    ],
)
def test_worker_cores_are_disjoint_runs_of_the_usable_cores(monkeypatch, cores, slot, slots, threads, expected) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    assert cpu_threads.worker_cores(slot, slots, threads) == expected


def test_every_slot_of_a_machine_gets_cores_no_other_slot_has(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    threads = cpu_threads.worker_threads(None, 4)
    taken = [core for slot in range(4) for core in cpu_threads.worker_cores(slot, 4, threads)]
    assert len(taken) == len(set(taken)) == 12 and max(taken) < 15  # one core left over at least


def test_core_list_is_tasksets_form() -> None:
    assert cpu_threads.core_list([0, 1, 2, 3, 8]) == "0-3,8"
    assert cpu_threads.core_list([5]) == "5"
    assert cpu_threads.core_list([1, 3]) == "1,3"
