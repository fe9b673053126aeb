"""Bad constraints are refused with a message naming the problem; the compile cache is bounded;
a compile past the time bound fails its request without stalling the event loop."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR
from conveyor.structured import (
    CompileTimeout,
    Constraint,
    ConstraintError,
    GrammarCompiler,
    allocate_bitmask,
    fill_rows,
)
from tests.no_torch import run_without_torch
from tests.structured.conftest import BACKEND, EOS, VOCAB

BACKEND_PATH = TOKENIZER_DIR / "tokenizer.json"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Constraint.json_schema({"type": "objekt"}), "invalid json_schema: Invalid type: objekt"),
        (lambda: Constraint.json_schema({"type": "string", "format": "weird"}), "Unknown format: weird"),
        (lambda: Constraint.regex("a(b"), "unclosed group"),
        (lambda: Constraint.grammar("root ::= ( "), "invalid grammar"),
        (lambda: Constraint.grammar("root ::= missing_rule"), "missing_rule"),
    ],
)
def test_engine_rejects_invalid_constraints(compiler, build, message) -> None:
    with pytest.raises(ConstraintError, match=message.replace("(", r"\(")):
        compiler.compile(build())
    assert len(compiler) == 0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Constraint.json_schema("{nope"), "json_schema: not valid JSON"),
        (lambda: Constraint.json_schema([1, 2]), "json_schema: must be a JSON object"),
        (lambda: Constraint.regex(""), "regex: must be a non-empty string"),
        (lambda: Constraint.choice("abc"), "choice: must be a list of strings"),
        (lambda: Constraint.choice([]), "choice: needs 1 to"),
        (lambda: Constraint.choice(["a", 3]), "choice: option 1 must be a non-empty string"),
        (lambda: Constraint.grammar("  "), "grammar: must be a non-empty string"),
        (lambda: Constraint.regex("a" * 300_000), "regex: 300000 characters"),
        (lambda: Constraint("xml", "<a/>"), "unknown constraint kind 'xml'"),
    ],
)
def test_malformed_input_is_refused_before_the_engine(build, message) -> None:
    with pytest.raises(ConstraintError, match=message):
        build()


def test_non_strict_schema_ignores_unknown_keywords(compiler) -> None:
    schema = {"type": "string", "format": "weird", "maxLength": 3}
    compiled = compiler.compile(Constraint.json_schema(schema, strict=False))
    m = compiled.matcher()
    assert all(m.accept(t) for t in BACKEND.encode('"ab"', add_special_tokens=False).ids) and m.is_accepting


def test_spellings_of_one_schema_share_a_cache_entry(compiler) -> None:
    a = compiler.compile(Constraint.json_schema({"type": "object", "required": [], "properties": {}}))
    b = compiler.compile(Constraint.json_schema('{"properties": {}, "required": [], "type": "object"}'))
    assert a is b and len(compiler) == 1


def test_cache_is_bounded_least_recently_used_first(engine_tokenizer) -> None:
    compiler = GrammarCompiler(engine_tokenizer, max_entries=3)
    regexes = [Constraint.regex(f"x{i}[0-9]+") for i in range(4)]
    first = [compiler.compile(c) for c in regexes[:3]]
    assert compiler.compile(regexes[0]) is first[0]  # a hit refreshes regexes[0]
    compiler.compile(regexes[3])  # evicts regexes[1], the least recently used
    assert len(compiler) == 3
    assert compiler.cached(regexes[1]) is None
    assert compiler.cached(regexes[0]) is first[0] and compiler.cached(regexes[2]) is first[2]
    assert compiler.compile(regexes[1]) is not first[1]
    compiler.close()


def test_compile_past_the_bound_times_out_without_stalling_the_loop(engine_tokenizer) -> None:
    """A schema of 3,000 properties takes ~0.5 s to compile here: far past a 50 ms bound. A ticker on
    the same loop keeps ticking meanwhile, and a cached constraint is served at once."""
    compiler = GrammarCompiler(engine_tokenizer, timeout_s=0.05)
    fast = Constraint.regex("[0-9]{2}")
    compiler.compile(fast)
    props = {f"p{i}": {"type": "string", "maxLength": 5} for i in range(3000)}
    slow = Constraint.json_schema({"type": "object", "properties": props, "required": sorted(props)})

    async def scenario() -> tuple[list[float], float]:
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        start = time.perf_counter()
        with pytest.raises(CompileTimeout, match="json_schema: took longer than 0.05 s to compile"):
            await compiler.compile_async(slow)
        waited = time.perf_counter() - start
        assert (await compiler.compile_async(fast)).constraint == fast
        task.cancel()
        return ticks, waited

    ticks, waited = asyncio.run(scenario())
    assert waited < 1.0
    assert len(ticks) >= 3 and max(np.diff(ticks)) < 0.5
    compiler.close()


def test_concurrent_requests_for_one_constraint_share_a_compile(compiler) -> None:
    constraint = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})

    async def both():
        return await asyncio.gather(compiler.compile_async(constraint), compiler.compile_async(constraint))

    a, b = asyncio.run(both())
    assert a is b and len(compiler) == 1


def test_matcher_rollback_restores_the_mask(compiler) -> None:
    m = compiler.compile(Constraint.regex(r"(cat|dog)s?")).matcher()
    start = allocate_bitmask(1, VOCAB)
    assert m.fill(start, 0)
    ids = BACKEND.encode("cats", add_special_tokens=False).ids
    assert all(m.accept(t) for t in ids) and m.is_accepting
    m.rollback(len(ids))
    again = allocate_bitmask(1, VOCAB)
    assert m.fill(again, 0)
    assert np.array_equal(start, again) and not m.is_accepting


def test_a_finished_grammar_allows_only_end_of_sequence(compiler) -> None:
    m = compiler.compile(Constraint.choice(["yes", "no"])).matcher()
    assert all(m.accept(t) for t in BACKEND.encode("yes", add_special_tokens=False).ids)
    bitmask = allocate_bitmask(1, VOCAB)
    assert m.fill(bitmask, 0) and m.is_terminated
    allowed = [t for t in range(VOCAB) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed == [EOS]


def test_dead_end_is_reported_not_sampled(compiler) -> None:
    """A token the grammar forbids (forced on it) leaves the matcher failed; the engine would
    then allow end-of-sequence only, which must read as a dead end, not as a normal stop."""
    m = compiler.compile(Constraint.regex("[0-9]+")).matcher()
    other = compiler.compile(Constraint.regex("[a-z]+")).matcher()
    assert not m.accept(BACKEND.token_to_id("a"))
    assert "doesn't satisfy the grammar" in m.error
    bitmask = allocate_bitmask(3, VOCAB)
    assert not m.fill(bitmask, 0)
    assert fill_rows([(m, 0), (other, 2)], bitmask) == [0]


def test_step_fill_writes_only_its_rows(compiler) -> None:
    grammars = [compiler.compile(c) for c in (Constraint.regex("[0-9]+"), Constraint.choice(["red", "blue"]))]
    batched, single = allocate_bitmask(4, VOCAB), allocate_bitmask(4, VOCAB)
    rows = [(grammars[0].matcher(), 1), (grammars[1].matcher(), 3)]
    assert fill_rows(rows, batched) == []
    for m, row in rows:
        assert m.fill(single, row)
    assert np.array_equal(batched, single)
    assert (batched[[0, 2]] == -1).all() and not np.array_equal(batched[1], batched[3])


def test_frontend_side_needs_no_torch(tmp_path) -> None:
    """The frontend compiles: the structured package must import and compile with torch blocked."""
    run_without_torch(
        f"""
        from conveyor.structured import Constraint, EngineTokenizer, GrammarCompiler
        tok = EngineTokenizer.from_file({str(BACKEND_PATH)!r}, [{EOS}])
        GrammarCompiler(tok).compile(Constraint.json_schema({{"type": "object"}}))
        """
    )


def test_without_the_engine_constraints_get_a_clear_error() -> None:
    """llguidance is optional: blocked, the package still imports and a compile says what to install."""
    run_without_torch(
        f"""
        import importlib.abc, sys
        class NoEngine(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "llguidance":
                    raise ImportError("blocked")
        sys.meta_path.insert(0, NoEngine())
        from conveyor.structured import Constraint, EngineTokenizer, StructuredOutputUnavailable, available
        assert not available()
        Constraint.json_schema({{"type": "object"}})  # validating the shape needs no engine
        try:
            EngineTokenizer.from_file({str(BACKEND_PATH)!r}, [{EOS}])
        except StructuredOutputUnavailable as e:
            assert "pip install 'conveyor[structured]'" in str(e), e
        else:
            raise AssertionError("no error without the engine")
        """
    )
