"""bin/serve on the CPU where Triton is not installed (a CPU install no longer carries it:
tests/test_install.py): every process starts and serves, greedy output as HF's. Triton is
made unimportable in every process by a ``triton`` package first on PYTHONPATH that
raises ImportError, so an import anywhere on the serving path would stop the server."""

from __future__ import annotations

import os

from conveyor.client import Client

BLOCKER = 'raise ImportError("triton is blocked in this test: serving on the CPU must not need it")\n'


def test_serving_on_cpu_never_imports_triton(serve_factory, tiny_checkpoint, hf_greedy, tmp_path, monkeypatch) -> None:
    blocked = tmp_path / "blocked"
    (blocked / "triton").mkdir(parents=True)
    (blocked / "triton" / "__init__.py").write_text(BLOCKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(blocked), os.environ.get("PYTHONPATH", "")]))
    server = serve_factory(
        "--model", str(tiny_checkpoint), "--device", "cpu", "--threads", "1", "--num-kv-blocks", "64"
    )
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    with Client(server.address, timeout=120) as client:
        for _ in range(2):  # the second reuses the first's cached prefix
            result = client.generate(token_ids=prompt, max_tokens=8, temperature=0, ignore_eos=True)
            assert result.token_ids == hf_greedy(prompt, 8)
    assert "triton is blocked" not in server.output()
