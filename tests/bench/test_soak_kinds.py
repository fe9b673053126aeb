"""bin/soak's checks of n > 1, log-probability and constrained finals (conveyor_tools/cli/soak_kinds.py):
each catches what it is for, on hand-made finals, and the draw stays seeded."""

from __future__ import annotations

import json
import random

from conveyor.client import Choice, CompletionResult, Usage
from conveyor_tools.cli.soak import draw
from conveyor_tools.cli.soak_kinds import (
    CHOICES,
    CONSTRAINTS,
    KIND_FIELDS,
    REGEX,
    SCHEMA,
    Mix,
    check_choices,
    logprobs_drift,
)

PROMPT = 6


def columns(start: int, rows: int, k: int) -> dict:
    return {
        "start": start, "tokens": ["a"] * rows, "token_logprobs": [-1.0] * rows,
        "top_token_ids": [[1] * k] * rows, "top_tokens": [["a"] * k] * rows, "top_logprobs": [[-1.0] * k] * rows,
    }  # fmt: skip


def final(*texts: str, tokens: int = 3, k: int | None = None, prompt_rows: int | None = None) -> CompletionResult:
    choices = [
        Choice(i, text, list(range(tokens)), "stop", None if k is None else columns(PROMPT, tokens, k))
        for i, text in enumerate(texts)
    ]
    prompt = None if prompt_rows is None else columns(1, prompt_rows, 1)
    return CompletionResult("r", texts[0], choices[0].token_ids, "stop", Usage(PROMPT, 3 * len(texts)),
                            choices=choices, logprobs=choices[0].logprobs, prompt_logprobs=prompt)  # fmt: skip


def test_a_valid_final_passes_every_check() -> None:
    fields = {"max_tokens": 3, "n": 2, "logprobs": 2, "prompt_logprobs": 1, "constraint": CONSTRAINTS[1]}
    assert check_choices(fields, final("the cat", "of a b", k=2, prompt_rows=PROMPT - 1), raw_prompt=False) == []


def test_each_choice_is_checked_like_a_single_result() -> None:
    fields = {"max_tokens": 2, "n": 2, "stop": ["xyz"]}
    failures = check_choices(fields, final("fine", "has xyz in it"), raw_prompt=False)
    assert failures == [
        "choice 0: 3 tokens for max_tokens=2",
        "choice 1: 3 tokens for max_tokens=2",
        "choice 1: stop string 'xyz' in its text 'has xyz in it'",
    ]
    assert check_choices({"max_tokens": 3, "n": 3}, final("a", "b"), raw_prompt=False) == [
        "2 choices (indices [0, 1]) for n=3"
    ]


def test_constrained_choices_must_be_valid_under_their_constraint() -> None:
    schema, regex, choice = CONSTRAINTS
    good = json.dumps({"word": "abc", "count": 3}, separators=(",", ":"))
    assert check_choices({"max_tokens": 3, "constraint": schema}, final(good), raw_prompt=False) == []
    (bad,) = check_choices(
        {"max_tokens": 3, "constraint": schema}, final('{"word":"abcdefgh","count":3}'), raw_prompt=False
    )
    assert "choice 0" in bad and "is too long" in bad, bad
    assert "Expecting" in check_choices({"max_tokens": 3, "constraint": schema}, final('{"word"'), raw_prompt=False)[0]
    assert check_choices({"max_tokens": 3, "constraint": regex}, final("the cat dog"), raw_prompt=False) == []
    assert (
        f"does not match {REGEX!r}"
        in check_choices({"max_tokens": 3, "constraint": regex}, final("cat"), raw_prompt=False)[0]
    )
    assert (
        check_choices({"max_tokens": 3, "n": 2, "constraint": choice}, final("maybe later", "no"), raw_prompt=False)
        == []
    )
    (bad,) = check_choices({"max_tokens": 3, "n": 2, "constraint": choice}, final("no", "nope"), raw_prompt=False)
    assert bad.startswith("choice 1") and f"is none of {CHOICES}" in bad
    calls = {"max_tokens": 3, "tools": [], "tool_choice": "required"}
    assert check_choices(calls, final('[{"name":"lookup","arguments":{"key":"k"}}]'), raw_prompt=False) == []
    assert check_choices(calls, final('[{"name":"other","arguments":{"key":"k"}}]'), raw_prompt=False)
    # A token-id prompt that ends inside a character leaves its U+FFFD at the output's start.
    assert check_choices({"max_tokens": 3, "constraint": choice}, final("\ufffdno"), raw_prompt=True) == []
    assert check_choices({"max_tokens": 3, "constraint": choice}, final("\ufffdno"), raw_prompt=False)
    # A choice cut by max_tokens is not held to its constraint.
    cut = final("the")
    cut.choices[0].finish_reason = "length"
    assert check_choices({"max_tokens": 3, "constraint": schema}, cut, raw_prompt=False) == []


def test_logprob_rows_are_one_per_token() -> None:
    fields = {"max_tokens": 3, "n": 2, "logprobs": 2}
    result = final("a", "b", k=2)
    result.choices[1].logprobs = columns(PROMPT, 2, 2)
    assert check_choices(fields, result, raw_prompt=False) == [
        "choice 1: 2 logprob rows from 6 for 3 tokens after a prompt of 6"
    ]
    result.choices[1].logprobs = columns(PROMPT, 3, 1)
    assert check_choices(fields, result, raw_prompt=False) == ["choice 1: logprobs top rows not of 2"]
    result.choices[1].logprobs = None
    assert check_choices(fields, result, raw_prompt=False) == ["choice 1: no logprobs for logprobs=2"]
    prompt = {"max_tokens": 3, "prompt_logprobs": 1}
    assert check_choices(prompt, final("a", prompt_rows=PROMPT - 1), raw_prompt=False) == []
    assert check_choices(prompt, final("a", prompt_rows=PROMPT), raw_prompt=False) == [
        "prompt_logprobs (start, rows) (1, 6) for a prompt of 6"
    ]


def test_the_draw_is_seeded_and_reaches_every_kind() -> None:
    mix = Mix.every_kind(loras=("a", "b"))
    drawn = [draw(random.Random(7), mix).kwargs() for _ in range(3)]
    assert drawn[0] == drawn[1] == drawn[2]
    rng = random.Random(0)
    seen = [draw(rng, mix).fields for _ in range(600)]
    assert KIND_FIELDS <= {key for fields in seen for key in fields}
    assert not any("stop" in f and ("constraint" in f or "tools" in f) for f in seen)
    assert not KIND_FIELDS & {key for _ in range(200) for key in draw(rng).fields}  # the plain mix stays plain
    assert {f["constraint"]["type"] for f in seen if "constraint" in f} == {"json_schema", "regex", "choice"}
    assert SCHEMA in [f["constraint"].get("schema") for f in seen if "constraint" in f]


def test_greedy_choices_agree_and_take_the_most_likely_token() -> None:
    fields = {"max_tokens": 3, "n": 2, "temperature": 0, "logprobs": 1}
    result = final("a", "b", k=1)
    for choice in result.choices:
        choice.logprobs["top_token_ids"] = [[t] for t in choice.token_ids]
    assert check_choices(fields, result, raw_prompt=False) == []
    result.choices[1].logprobs["top_token_ids"][2] = [9]
    assert check_choices(fields, result, raw_prompt=False) == [
        "choice 1: greedy tokens [0, 1, 2] are not the most likely [0, 1, 9]"
    ]
    assert (
        check_choices({**fields, "ignore_eos": True}, result, raw_prompt=False) == []
    )  # EOS masked: not the raw argmax
    result.choices[1].token_ids = [0, 1, 9]
    assert "greedy choices differ" in check_choices(fields, result, raw_prompt=False)[0]


def test_replayed_logprobs_may_drift_only_a_little() -> None:
    a, b = final("a", "b", k=1, prompt_rows=5), final("a", "b", k=1, prompt_rows=5)
    assert logprobs_drift(a, b) == 0.0
    b.choices[1].logprobs["token_logprobs"] = [-1.0, -1.5, -1.0]
    b.prompt_logprobs["token_logprobs"] = [-1.0, -1.0, -1.0, -1.0, -1.25]
    assert logprobs_drift(a, b) == 0.5
