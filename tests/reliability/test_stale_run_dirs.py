"""A bin/serve killed with -9 (its whole tree, so nothing could clean up) leaves its run
directory and shared-memory rings; the next start removes them (issue 43, finding 8;
conveyor.ipc.run_dirs). A run directory whose owner still runs, or that has no owner file, is
never touched."""

from __future__ import annotations

import os
import signal

from conveyor.ipc import run_dirs
from conveyor.ipc.shm_ring import process_start_time
from tests.e2e.serve_harness import children_of, mapped_ring_files, run_dir_of, still_alive_after
from tests.reliability.conftest import SERVE_ARGS


def test_a_dead_owners_run_dir_and_rings_are_reaped_a_live_ones_kept(tmp_path, monkeypatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(run_dirs, "SHM_DIR", str(shm))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = tmp_path / "conveyor-dead1"
    dead.mkdir()
    (dead / "owner").write_text(f"{os.getpid()} {process_start_time(os.getpid()) + 1}\n")  # a pid reused since
    (shm / "conveyor-dead1-plans.ring").write_bytes(b"x")
    (shm / "conveyor-dead1-plans.ring.bell0").write_bytes(b"x")
    live = tmp_path / "conveyor-live1"
    live.mkdir()
    (live / "owner").write_text(f"{os.getpid()} {process_start_time(os.getpid())}\n")
    (shm / "conveyor-live1-plans.ring").write_bytes(b"x")
    unclaimed = tmp_path / "conveyor-old1"
    unclaimed.mkdir()
    fresh = run_dirs.make_run_dir()
    assert not dead.exists() and sorted(os.listdir(shm)) == ["conveyor-live1-plans.ring"]
    assert live.exists() and unclaimed.exists() and os.path.isdir(fresh)
    assert open(os.path.join(fresh, "owner")).read().split()[0] == str(os.getpid())


def test_the_next_start_removes_what_a_kill_9_left(serve_factory, tiny_checkpoint) -> None:
    first = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    run_dir = run_dir_of(first.pids["frontend"])
    rings = mapped_ring_files(first.pids["worker"])
    assert os.path.isdir(run_dir) and len(rings) == 2
    tree = children_of(first.proc.pid)
    for pid in [first.proc.pid, *tree]:  # the whole tree at once: no process can clean up
        os.kill(pid, signal.SIGKILL)
    first.proc.wait(10)
    assert not still_alive_after(tree, 5)
    assert os.path.isdir(run_dir) and all(os.path.exists(path) for path in rings)  # left behind
    second = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    assert not os.path.exists(run_dir)
    assert not [path for path in rings if os.path.exists(path)]
    assert run_dir_of(second.pids["frontend"]) != run_dir
