"""conveyor.Engine and bin/serve's frontend share one request processor
(conveyor.frontend.processor): the same requests sent through both get the same tokens, text,
finish reasons, log-probabilities and the same error messages. The demo model (random weights,
varied text), one request at a time on each side, so each runs alone in its batch."""

from __future__ import annotations

import pytest

from conveyor.client import Client
from conveyor.client.connection import ServerError
from tests.e2e.conftest import serve_factory, tiny_checkpoint  # noqa: F401  (fixtures, registered here)
from tests.e2e.serve_harness import ServeProcess

PROMPT = "The history of the printing press"
GREEDY = dict(temperature=0.0, ignore_eos=True)

# name -> add_request / generate keyword arguments. Each is read by the one processor: its
# defaults (max_tokens, skip_special_tokens, ...), its n > 1 forking, stop strings, logprobs.
REQUESTS = {
    "plain": dict(prompt=PROMPT, max_tokens=12, **GREEDY),
    "default_max_tokens": dict(prompt=PROMPT, **GREEDY),
    "n3_seeded": dict(prompt=PROMPT, max_tokens=8, n=3, temperature=0.9, seed=7, ignore_eos=True),
    "best_of": dict(prompt=PROMPT, max_tokens=6, n=2, best_of=3, temperature=0.9, seed=3, ignore_eos=True),
    "stop_string": dict(prompt=PROMPT, max_tokens=40, stop=["e"], **GREEDY),
    "stop_included": dict(prompt=PROMPT, max_tokens=40, stop=["e"], include_stop_str_in_output=True, **GREEDY),
    "logprobs": dict(prompt=PROMPT, max_tokens=5, logprobs=3, prompt_logprobs=2, **GREEDY),
    "n2_logprobs": dict(prompt=PROMPT, max_tokens=4, n=2, logprobs=2, temperature=0.9, seed=1, ignore_eos=True),
    "token_ids": dict(token_ids=[5, 6, 7, 8], max_tokens=6, **GREEDY),
    "truncated": dict(prompt=PROMPT, truncate_prompt_tokens=3, max_tokens=5, **GREEDY),
}
BAD = {
    "too_many_logprobs": dict(prompt=PROMPT, logprobs=21),
    "prompt_too_long": dict(prompt="word " * 3000),
    "max_tokens_too_big": dict(prompt=PROMPT, max_tokens=10**6),
    "token_out_of_vocabulary": dict(token_ids=[1, 10**7]),
    "bad_temperature": dict(prompt=PROMPT, temperature=-1.0),
    "bad_stop": dict(prompt=PROMPT, stop=[1]),
    "two_inputs": dict(prompt=PROMPT, token_ids=[1, 2]),
    "min_over_max": dict(prompt=PROMPT, max_tokens=2, min_tokens=5),
    "empty_prompt": dict(prompt=""),
}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(engine, client of bin/serve) on the demo model, with the same pool and one thread each."""
    from conveyor import Engine

    engine = Engine("demo", num_kv_blocks=128, threads=1, device="cpu")
    serve = ServeProcess(
        ["--model", "demo", "--num-kv-blocks", "128", "--threads", "1"], tmp_path_factory.mktemp("serve")
    )
    try:
        with Client(serve.address) as client:
            yield engine, client
    finally:
        serve.shut_down(list(serve.pids.values()))


def engine_outcome(engine, fields: dict) -> dict:
    fields = dict(fields)
    try:
        request = engine.add_request(fields.pop("prompt", None), **fields)
    except (ValueError, TypeError) as exc:
        return {"error": str(exc)}
    while not request.done:
        engine.step()
    outcome = {
        "finish_reason": request.finish_reason,
        "choices": [(s.index, s.tokens, s.text, s.finish_reason) for s in request.outputs],
        # (best_of without logprobs: the engine shows the ranking's, which a client is never sent)
        "logprobs": [_entries(s.logprobs) if "logprobs" in fields else None for s in request.outputs],
        "prompt_logprobs": None if request.prompt_logprobs is None else _entries(request.prompt_logprobs[1:]),
    }
    request.remove()
    return outcome


def _entries(entries) -> list | None:
    if entries is None:
        return None
    return [(e.token_id, round(e.logprob, 4), [t.token_id for t in e.top]) for e in entries]


def _columns(cols, token_ids) -> list | None:
    """The protocol's columns as the engine's entries; ``token_ids``: the rows' tokens."""
    if cols is None:
        return None
    return [
        (t, round(v, 4), list(top))
        for t, v, top in zip(token_ids, cols["token_logprobs"], cols["top_token_ids"], strict=True)
    ]


def server_outcome(client, engine, fields: dict) -> dict:
    fields = dict(fields)
    prompt = fields.pop("prompt", None)
    try:
        result = client.generate(prompt, **fields)
    except ServerError as exc:
        return {"error": str(exc)}
    if result.error is not None:
        return {"error": result.error}
    prompt_ids = None
    if result.prompt_logprobs is not None:  # its tokens: the prompt's, as the engine tokenizes it
        prompt_ids = engine.tokenizer.encode(prompt)
    return {
        "finish_reason": result.finish_reason,
        "choices": [(c.index, c.token_ids, c.text, c.finish_reason) for c in result.choices],
        "logprobs": [_columns(c.logprobs, c.token_ids) if c.logprobs else None for c in result.choices],
        "prompt_logprobs": None if prompt_ids is None else _columns(result.prompt_logprobs, prompt_ids[1:]),
    }


@pytest.mark.parametrize("name", REQUESTS)
def test_same_outputs(both, name):
    engine, client = both
    fields = REQUESTS[name]
    ours, theirs = engine_outcome(engine, fields), server_outcome(client, engine, fields)
    assert "error" not in ours and "error" not in theirs, (ours, theirs)
    assert ours == theirs
    assert any(tokens for _, tokens, _, _ in ours["choices"])


@pytest.mark.parametrize("name", BAD)
def test_same_errors(both, name):
    engine, client = both
    ours, theirs = engine_outcome(engine, BAD[name]), server_outcome(client, engine, BAD[name])
    assert "error" in ours, ours
    assert ours == theirs
