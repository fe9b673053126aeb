"""The batching engine as a library: ``conveyor.Engine``, bin/serve's scheduler and model
runner in one process, no sockets (:mod:`conveyor.engine.engine` says what it shares with
the server and how a step runs).

- :mod:`~conveyor.engine.engine`: :class:`Engine` (add requests, step, generate);
- :mod:`~conveyor.engine.request`: :class:`Request`, what the caller reads (tokens, text, end);
- :mod:`~conveyor.engine.outputs`: :class:`StepOutput` and its :class:`BatchInfo`, :class:`Result`
  (its :class:`CompletionOutput` per sequence);
- :mod:`~conveyor.engine.options`: ``Engine(**config)``'s names (bin/serve's, TGI's batch limits);
- :mod:`~conveyor.engine.ranks`: the tensor-parallel ranks an engine starts, :class:`RanksFailed`.

torch is imported when an :class:`Engine` is built, not with this package.
"""

from __future__ import annotations

from conveyor.engine.engine import Engine
from conveyor.engine.outputs import BatchInfo, CompletionOutput, Result, StepOutput
from conveyor.engine.ranks import RanksFailed
from conveyor.engine.request import Request, TextDelta

__all__ = ["BatchInfo", "CompletionOutput", "Engine", "RanksFailed", "Request", "Result", "StepOutput", "TextDelta"]
