"""Compiling a request's constraint where the tokenizer is: the frontend (off its event loop)
and the in-process engine.

The compile validates the schema, regex or grammar against the model's tokenizer, so a bad
one is refused (``invalid_field``, the engine's message naming the problem) before the
request reaches the scheduler and any KV is allocated; its result, llguidance's serialized
grammar, travels with the request (``SamplingParams.grammar``) for the worker to rebuild a
matcher from (:mod:`conveyor.worker.grammar_rows`). The compiler and its tokenizer are built
on the first constrained request, so a server that never sees one pays nothing.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec

from conveyor.protocol import requests as client_requests
from conveyor.protocol import wire
from conveyor.structured.compiler import DEFAULT_TIMEOUT_S, GrammarCompiler
from conveyor.structured.constraint import ConstraintError
from conveyor.structured.grammar_engine import EngineTokenizer


class ConstraintCompiler:
    """One served model's :class:`GrammarCompiler` (LRU cache, timeout), made on first use."""

    def __init__(self, model_dir: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._model_dir = model_dir
        self._timeout_s = timeout_s
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(EngineTokenizer.for_model(self._model_dir), timeout_s=self._timeout_s)
            return self._compiler

    def compile(self, req: client_requests.GenerateRequest) -> None:
        """Compile ``req.constraint`` on this thread (the engine) and set ``req.sampling.grammar``."""
        if req.constraint is None:
            return
        try:
            grammar = self._get().compile(req.constraint).grammar
        except ConstraintError as exc:
            raise wire.ProtocolError(str(exc), req.request_id) from None
        req.sampling = msgspec.structs.replace(req.sampling, grammar=grammar)

    async def compile_async(self, req: client_requests.GenerateRequest) -> None:
        """As :meth:`compile`, never blocking the event loop: the first call builds the
        tokenizer on a thread, every compile runs in the compiler's pool, bounded by its timeout."""
        if req.constraint is None:
            return
        try:
            compiler = self._compiler or await asyncio.get_running_loop().run_in_executor(None, self._get)
            grammar = (await compiler.compile_async(req.constraint)).grammar
        except ConstraintError as exc:
            raise wire.ProtocolError(str(exc), req.request_id) from None
        req.sampling = msgspec.structs.replace(req.sampling, grammar=grammar)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
