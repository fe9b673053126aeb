""":meth:`Engine.embed`: embeddings of several inputs through the engine's batching.

Each input is one prompt-only pooling request (``pooling``, :mod:`conveyor.worker.pooling`):
it samples nothing and gives its KV back once its prompt has run, so embeddings batch with
whatever else the engine runs (the same steps), as they do in bin/serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from conveyor.ipc.messages import FinishReason


class _Engine(Protocol):
    """What :func:`embed` uses of :class:`~conveyor.engine.engine.Engine` (named, not
    imported: the engine imports this module)."""

    def add_request(self, prompt: str | None = None, **fields: Any) -> Any: ...

    def step(self) -> Any: ...

    def _wait_until_ready(self) -> None: ...


def embed(engine: _Engine, inputs: Sequence[str | Sequence[int]], *, pooling: str = "last") -> list[list[float]]:
    """The L2-normalized embedding of each input (text, tokenized with BOS as a prompt is, or
    token ids), in order: the model's final hidden states (after its final norm) pooled by
    ``pooling``: ``last`` (the last prompt position's, vLLM's default for decoder models) or
    ``mean`` (over the prompt). Steps the engine until they are done (requests added
    otherwise run alongside); ValueError naming the input for one the server refuses or fails."""
    requests: list[Any] = []  # conveyor.engine.request.Request
    try:
        for i, item in enumerate(inputs):
            field = {"prompt": item} if isinstance(item, str) else {"token_ids": item}
            try:
                requests.append(engine.add_request(**field, pooling=pooling, max_tokens=1))
            except ValueError as exc:
                raise ValueError(f"inputs[{i}]: {exc}") from exc
        while not all(r.done for r in requests):
            out = engine.step()
            if out.batch is None and not out.requests:
                engine._wait_until_ready()
        vectors = []
        for i, request in enumerate(requests):
            if request.finish_reason != FinishReason.STOP or request.embedding is None:
                raise ValueError(f"inputs[{i}]: {request.error or request.finish_reason}")
            vectors.append(request.embedding)
        return vectors
    finally:
        for request in requests:
            request.remove()
