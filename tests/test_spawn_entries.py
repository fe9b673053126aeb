"""How bin/serve starts its children (conveyor.runtime.process.run_entry, run_entry_when_sent):
by name, so bin/serve imports none of their modules, and a child started before its config
runs once the config is sent, or ends quietly when bin/serve closes the pipe unsent."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

from conveyor.runtime.process import run_entry, run_entry_when_sent

ENTRY = "tests.test_spawn_entries:write_config"
SPAWN = mp.get_context("spawn")


def write_config(config: tuple[str, str]) -> None:
    path, text = config
    Path(path).write_text(text)


def test_a_child_runs_its_entry_by_name(tmp_path):
    proc = SPAWN.Process(target=run_entry, args=(ENTRY, (str(tmp_path / "out"), "by name")))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and (tmp_path / "out").read_text() == "by name"


def test_a_child_started_early_runs_when_its_config_is_sent(tmp_path):
    receive, send = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=run_entry_when_sent, args=(ENTRY, receive))
    proc.start()
    receive.close()
    proc.join(0.5)
    assert proc.is_alive() and not (tmp_path / "out").exists()  # waiting for its config
    send.send((str(tmp_path / "out"), "sent later"))
    send.close()
    proc.join(60)
    assert proc.exitcode == 0 and (tmp_path / "out").read_text() == "sent later"


def test_a_child_whose_config_never_comes_ends_quietly(tmp_path):
    receive, send = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=run_entry_when_sent, args=(ENTRY, receive))
    proc.start()
    receive.close()
    send.close()  # a start-up that failed before the config existed
    proc.join(60)
    assert proc.exitcode == 0 and not list(tmp_path.iterdir())


def test_bin_serve_imports_none_of_its_childrens_modules():
    heavy = ("torch", "aiohttp", "conveyor.worker.main", "conveyor.frontend.server", "conveyor.scheduler.scheduler")
    code = f"import sys, conveyor.cli.serve; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
