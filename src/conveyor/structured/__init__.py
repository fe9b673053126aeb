"""Structured output: constraints (JSON schema, JSON object, regex, choice, grammar) compiled
against the model's tokenizer, per-request matchers that fill next-token bitmasks, and the
parsing of tool calls out of model text. No torch here: the frontend compiles and parses;
the worker fills masks and applies them with :mod:`conveyor.worker.grammar_mask`.
docs/structured-output.md has the engine choice and its figures."""

from conveyor.structured.compiler import CompiledGrammar, CompileTimeout, GrammarCompiler
from conveyor.structured.constraint import Constraint, ConstraintError
from conveyor.structured.grammar_engine import EngineTokenizer, StructuredOutputUnavailable, available
from conveyor.structured.matcher import GrammarMatcher, allocate_bitmask, bitmask_width, fill_rows

__all__ = [
    "CompileTimeout",
    "CompiledGrammar",
    "Constraint",
    "ConstraintError",
    "EngineTokenizer",
    "GrammarCompiler",
    "GrammarMatcher",
    "StructuredOutputUnavailable",
    "allocate_bitmask",
    "available",
    "bitmask_width",
    "fill_rows",
]
