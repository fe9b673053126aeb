"""Every output of a constrained request matches its constraint: hypothesis draws the
constraint, a random-logits "model" samples under the mask (tests/structured/conftest.py),
and the text is checked by an independent judge (jsonschema, ``re``, a parser)."""

from __future__ import annotations

import json
import re
import string

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.structured import Constraint
from tests.structured.conftest import BACKEND, generate_batch

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
NAMES = st.from_regex(r"[a-z][a-z_]{0,7}", fullmatch=True)
WORDS = st.text(alphabet=string.ascii_letters + " -", min_size=1, max_size=6)

# Leaves bound their size (maxLength, ranges, maxItems): the model is random and would
# otherwise write a string until it ran out of tokens. additionalProperties is false for the
# same reason (and because OpenAI's strict mode requires it).
LEAF = st.one_of(
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3),
        st.integers(0, 6),
    ),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 5000),
    ),
    st.just({"type": "boolean"}),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda xs: {"enum": xs}),
)
ARRAY = st.builds(
    lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
    LEAF,
    st.integers(0, 2),
    st.integers(0, 2),
)


def _object(values: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict, data) -> dict:
        required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True))
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return st.builds(build, st.dictionaries(NAMES, values, min_size=1, max_size=5), st.data())


SCHEMAS = _object(st.one_of(LEAF, ARRAY, _object(LEAF)))


@SETTINGS
@given(schemas=st.lists(SCHEMAS, min_size=1, max_size=3), seed=st.integers(0, 2**31))
def test_json_schema_outputs_validate(compiler, schemas, seed) -> None:
    grammars = [compiler.compile(Constraint.json_schema(s)) for s in schemas]
    for schema, text in zip(schemas, generate_batch(grammars, seed)):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_accepts_objects_only(compiler) -> None:
    """Any JSON object may nest and run without bound, so a random model need not finish one
    (its strings go on): the random run must only never dead-end, and the texts a client could
    get are walked token by token."""
    grammar = compiler.compile(Constraint.json_object())
    generate_batch([grammar] * 4, seed=1, max_tokens=100, must_end=False)
    for text, whole in [('{"a": [1, {"b": null}], "c": "x"}', True), ("{}", True), ('{"a": 1', False), ("[1]", None)]:
        m = grammar.matcher()
        ids = BACKEND.encode(text, add_special_tokens=False).ids
        accepted = all(m.accept(t) for t in ids)
        assert accepted == (whole is not None), text
        if whole is not None:
            assert m.is_accepting == whole, text


REGEXES = [
    r"\d{3}-[a-z]{2,8}-(red|green|blue)",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}\.",
    r"(0|[1-9][0-9]{0,4})(\.[0-9]{1,3})?",
    r"[a-f0-9]{8}",
]


@SETTINGS
@given(pattern=st.sampled_from(REGEXES), seed=st.integers(0, 2**31))
def test_regex_outputs_match(compiler, pattern, seed) -> None:
    (text,) = generate_batch([compiler.compile(Constraint.regex(pattern))], seed)
    assert re.fullmatch(pattern, text), (pattern, text)


@SETTINGS
@given(options=st.lists(WORDS, min_size=1, max_size=6, unique=True), seed=st.integers(0, 2**31))
def test_choice_outputs_are_one_of_the_options(compiler, options, seed) -> None:
    (text,) = generate_batch([compiler.compile(Constraint.choice(options))], seed)
    assert text in options


ARITHMETIC = 'root ::= expr\nexpr ::= term ("+" term){0,3}\nterm ::= num | "(" expr ")"\nnum ::= [0-9]{1,3}'


def _parses_as_arithmetic(text: str) -> bool:
    """An independent check of ARITHMETIC: strip innermost parentheses until none are left."""
    flat = re.compile(r"[0-9]{1,3}(\+[0-9]{1,3})*")
    while "(" in text:
        text, n = re.subn(r"\(([0-9+]*)\)", lambda m: m.group(1) if flat.fullmatch(m.group(1)) else "!", text)
        if n == 0:
            return False
    return bool(flat.fullmatch(text))


@SETTINGS
@given(seed=st.integers(0, 2**31))
def test_grammar_outputs_parse(compiler, seed) -> None:
    (text,) = generate_batch([compiler.compile(Constraint.grammar(ARITHMETIC))], seed, max_tokens=1000)
    assert _parses_as_arithmetic(text), text
