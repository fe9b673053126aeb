"""Conveyor: an LLM serving system built around continuous batching.

Processes, one folder each: ``conveyor.frontend`` (tokenizer, client socket),
``conveyor.scheduler`` (the continuous batcher), ``conveyor.worker`` (model and KV cache on
the device). What they share: ``conveyor.protocol`` (the client-facing wire format),
``conveyor.ipc`` (internal messages, their codec and the transports between processes),
``conveyor.runtime`` (server config, process harness), ``conveyor.checkpoints`` (model config,
demo checkpoint), ``conveyor.profiling``. Triton kernels live in ``conveyor.kernels``; the
command-line tools in ``conveyor.cli``; bin/bench's harness in ``conveyor_tools.bench``.
``conveyor.Engine`` (``conveyor.engine``) is the scheduler and the model runner in one
process, as a library. docs/architecture.md opens with the whole map.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.version import __version__

__all__ = ["Engine", "__version__"]

if TYPE_CHECKING:
    from conveyor.engine import Engine


def __getattr__(name: str):
    """``conveyor.Engine``, imported on first use: the processes that never load torch (the
    frontend, the scheduler) import ``conveyor`` too, and must not pay for the engine's imports."""
    if name == "Engine":
        from conveyor.engine import Engine

        return Engine
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
