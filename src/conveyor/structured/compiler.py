"""Compiling constraints against a tokenizer, cached and kept off the event loop.

One :class:`GrammarCompiler` per tokenizer. Compiling is validating the grammar (the
:class:`ConstraintError` that becomes a 400 before any KV is allocated), building a prototype
matcher and computing its first mask, so the lexer states the first step needs exist before
the request is admitted. Each request's matcher is a deep copy of the prototype (~10 us).

The cache is an LRU bounded by entries and keyed by (tokenizer id, constraint). The frontend
calls :meth:`GrammarCompiler.compile_async`: the work runs in a small thread pool (llguidance
releases the GIL while it builds), concurrent requests for one constraint share one compile,
and a compile that outlasts ``timeout_s`` fails its requests with :class:`CompileTimeout`
while other streams go on. The thread itself cannot be stopped; the engine's own limits on
grammar size and lexer work bound how long it can run, and if it finishes its result is cached.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from conveyor.structured.constraint import Constraint, ConstraintError
from conveyor.structured.grammar_engine import EngineTokenizer, grammar_text, load_llguidance, validate
from conveyor.structured.matcher import GrammarMatcher, allocate_bitmask

DEFAULT_CACHE_ENTRIES = 256
DEFAULT_TIMEOUT_S = 10.0


class CompileTimeout(ConstraintError):
    """The constraint took longer than the bound to compile; the request is refused."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated constraint for one tokenizer. ``grammar`` is the engine's text form, small
    enough to travel with the request to the worker, which compiles it again from its own
    cache (a matcher cannot cross a process boundary)."""

    constraint: Constraint
    tokenizer_id: str
    grammar: str = field(repr=False)
    _prototype: Any = field(repr=False, compare=False)

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: EngineTokenizer,
        *,
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        threads: int = 2,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self._cache: OrderedDict[tuple[str, Constraint], CompiledGrammar] = OrderedDict()
        self._inflight: dict[tuple[str, Constraint], concurrent.futures.Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")

    def __len__(self) -> int:
        return len(self._cache)

    def cached(self, constraint: Constraint) -> CompiledGrammar | None:
        key = (self.tokenizer.id, constraint)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile on the calling thread (the worker; tests), through the cache."""
        return self.cached(constraint) or self._store(self._build(constraint))

    async def compile_async(self, constraint: Constraint) -> CompiledGrammar:
        """Compile in the pool without blocking the event loop; :class:`CompileTimeout` past the bound."""
        hit = self.cached(constraint)
        if hit is not None:
            return hit
        key = (self.tokenizer.id, constraint)
        with self._lock:
            future = self._inflight.get(key)
            if future is None:
                future = self._pool.submit(self._compile_shared, key)
                self._inflight[key] = future
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            raise CompileTimeout(
                f"{constraint.kind}: took longer than {self.timeout_s:g} s to compile; simplify it"
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_shared(self, key: tuple[str, Constraint]) -> CompiledGrammar:
        try:
            return self._store(self._build(key[1]))
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _store(self, compiled: CompiledGrammar) -> CompiledGrammar:
        key = (compiled.tokenizer_id, compiled.constraint)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, constraint: Constraint) -> CompiledGrammar:
        grammar = grammar_text(constraint)
        validate(self.tokenizer, grammar, constraint.kind)
        prototype = load_llguidance().LLMatcher(self.tokenizer.ll, grammar, log_level=0)
        first = GrammarMatcher(prototype)
        if not first.fill(allocate_bitmask(1, self.tokenizer.mask_vocab), 0):
            raise ConstraintError(f"invalid {constraint.kind}: {first.error or 'no token can start a match'}")
        return CompiledGrammar(constraint, self.tokenizer.id, grammar, prototype)
