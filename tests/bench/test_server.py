"""BenchServer keeps the log of a bin/serve that failed, where the temporary directory goes."""

from __future__ import annotations

import pytest

from conveyor_tools.bench.server import BenchServer, ServeError


def test_the_log_of_a_server_that_failed_to_start_is_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONVEYOR_SERVE_LOG_DIR", str(tmp_path / "kept"))
    server = BenchServer(["--model", str(tmp_path / "no-such-checkpoint"), "--device", "cpu"])
    with pytest.raises(ServeError):
        server.start()
    kept = list((tmp_path / "kept").iterdir())
    assert len(kept) == 1 and "no-such-checkpoint" in kept[0].read_text()
    assert not server.log_path.exists()  # the temporary directory is gone
    assert str(kept[0]) in capsys.readouterr().err
