"""Structured output through ``conveyor.Engine`` (scheduler and model runner in one process) on
the tiny random Llama: the model is random, so only the grammar mask can make its output match
the constraint. Unconstrained rows batched with constrained ones must keep transformers' greedy
tokens (the mask touches only its rows), a bad constraint is refused before anything is queued,
and no KV block is left held."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conveyor.protocol import wire
from tests.engine.conftest import run_all
from tests.structured.test_properties import SCHEMAS

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def json_schema(schema=SCHEMA, strict=True):
    return {"type": "json_schema", "schema": schema, "strict": strict}


def test_mixed_batch_constrained_rows_match_and_free_rows_equal_hf(tiny_engine, hf_greedy):
    engine = tiny_engine(max_batch_size=8)
    free_prompts = [[5, 17, 29, 41, 53, 65], [7, 9, 11, 13], [100, 3, 47, 47, 2, 9, 8]]
    free = [engine.add_request(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in free_prompts]
    constrained = [
        engine.add_request(prompt=f"person {i}:", max_tokens=120, temperature=t, seed=i, constraint=json_schema())
        for i, t in enumerate([0.0, 1.0, 1.0, 0.7])
    ]
    regex = engine.add_request(
        prompt="a date",
        max_tokens=40,
        temperature=1.0,
        seed=3,
        constraint={"type": "regex", "pattern": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    )
    choice = engine.add_request(
        prompt="pick",
        max_tokens=40,
        temperature=1.0,
        seed=4,
        constraint={"type": "choice", "choices": ["yes", "no", "maybe later"]},
    )
    run_all(engine)
    for request, prompt in zip(free, free_prompts):
        assert request.tokens == hf_greedy(prompt, 12)
    for request in constrained:
        assert request.finish_reason == "stop", request
        jsonschema.validate(json.loads(request.text), SCHEMA)
    assert regex.finish_reason == "stop" and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", regex.text)
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no", "maybe later")
    assert engine.stats()["held_blocks"] == 0


def test_complete_grammar_stops_even_when_eos_is_ignored(tiny_engine):
    engine = tiny_engine()
    request = engine.add_request(
        prompt="x",
        max_tokens=60,
        temperature=1.0,
        seed=1,
        ignore_eos=True,
        constraint={"type": "choice", "choices": ["alpha", "beta"]},
    )
    run_all(engine)
    assert request.finish_reason == "stop" and request.text in ("alpha", "beta")


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (json_schema({"type": "objekt"}), "json_schema"),
        ({"type": "regex", "pattern": "([a-z]"}, "regex"),
        ({"type": "grammar", "grammar": "start: foo("}, "grammar"),
        ({"type": "choice", "choices": []}, "choice"),
    ],
)
def test_bad_constraint_is_refused_before_queueing(tiny_engine, constraint, named):
    engine = tiny_engine()
    with pytest.raises(wire.ProtocolError, match=named) as refused:
        engine.add_request(prompt="x", constraint=constraint)
    assert refused.value.code == wire.INVALID_FIELD
    assert not engine.has_pending_requests()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_constrained_requests_stay_valid(tiny_engine, preemption):
    """A pool too small for the batch preempts requests mid-answer; a resumed request's matcher
    is rebuilt from its outputs, so its answer still validates (a matcher restarted at the
    grammar's start would reject the resumed output and end it as a dead end)."""
    engine = tiny_engine(num_kv_blocks=40, preemption=preemption, swap_space=0.01, max_batch_size=6)
    requests = [
        engine.add_request(
            prompt=f"record number {i} follows:", max_tokens=110, temperature=1.0, seed=10 + i, constraint=json_schema()
        )
        for i in range(6)
    ]
    run_all(engine)
    stats = engine.stats()
    assert stats[f"num_preemptions_{preemption}"] > 0
    for request in requests:
        assert request.finish_reason == "stop", request
        jsonschema.validate(json.loads(request.text), SCHEMA)
    assert stats["held_blocks"] == 0


@pytest.fixture(scope="module")
def shared_engine(tiny_checkpoint):
    """One engine for every hypothesis example (a new one per example would rebuild the model)."""
    from conveyor import Engine
    from tests.engine.conftest import TINY

    return Engine(tiny_checkpoint, **{**TINY, "max_batch_size": 8})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Found by this test: the draw put a disallowed token (the grammar allowed only '"') because its
# uniform noise rounded to 1.0 in float32 (worker/sampler.py, _NOISE_BITS).
@example(
    schemas=[
        {
            "type": "object",
            "properties": {"a": {"type": "string", "minLength": 0, "maxLength": 0}},
            "required": [],
            "additionalProperties": False,
        }
    ],
    seed=162,
    temperature=0.8,
)
@given(
    schemas=st.lists(SCHEMAS, min_size=1, max_size=3),
    seed=st.integers(0, 2**31),
    temperature=st.sampled_from([0.0, 0.8, 1.0]),
)
def test_hypothesis_schemas_validate_through_the_model(shared_engine, schemas, seed, temperature):
    """The issue's property: hypothesis draws JSON schemas (tests/structured's strategy), the
    random tiny model writes under them in one batch, and every output parses and validates;
    nothing is left held."""
    requests = [
        shared_engine.add_request(
            prompt=f"record {i}:",
            max_tokens=200,
            temperature=temperature,
            seed=seed + i,
            constraint=json_schema(schema),
        )
        for i, schema in enumerate(schemas)
    ]
    run_all(shared_engine)
    for request, schema in zip(requests, schemas):
        assert request.finish_reason == "stop", (request.finish_reason, request.text, schema)
        jsonschema.validate(json.loads(request.text), schema)
        request.remove()
    assert shared_engine.stats()["held_blocks"] == 0


def test_n_sequences_each_follow_the_constraint_as_single_requests(tiny_engine):
    """n = 4 under a JSON schema: each sequence has its own matcher (the worker builds one per
    slot; a fork starts its own at the prompt's end), so sequence i writes exactly what a
    single request with seed + i writes, and every choice validates."""
    engine = tiny_engine(max_batch_size=8)
    common = dict(prompt="person:", max_tokens=120, temperature=1.0, constraint=json_schema(), logprobs=1)
    alone = [engine.add_request(seed=7 + i, **common) for i in range(4)]
    run_all(engine)
    together = engine.add_request(seed=7, n=4, **common)
    run_all(engine)
    assert len({tuple(a.tokens) for a in alone}) > 1
    for seq, single in zip(together.outputs, alone, strict=True):
        assert seq.finish_reason == "stop" and seq.tokens == single.tokens, (seq.text, single.text)
        jsonschema.validate(json.loads(seq.text), SCHEMA)
        assert [e.token_id for e in seq.logprobs] == seq.tokens
    assert engine.stats()["held_blocks"] == 0
