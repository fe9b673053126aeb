"""Parallel sampling (``n`` sequences of one request sharing its prompt's KV) on a real model:
the scheduler and the model runner of ``conveyor.Engine`` driven directly, on the tiny random
Llama, checked against transformers (greedy) and against single requests (seeded)."""

from __future__ import annotations

import time

import pytest

from conveyor.ipc.messages import AddRequest, SamplingParams
from tests import plans
from tests.engine.conftest import TINY  # noqa: F401  (the tiny_engine fixture's config)

PROMPT = [5, 17, 33, 2, 41, 9, 12, 28, 3, 50]  # 10 tokens: two full blocks of 4 and a partial one


def run(engine, requests: list[AddRequest]) -> tuple[dict[str, list[int]], int, int]:
    """Run ``requests`` to the end; (tokens by scheduler id, peak GPU blocks held, block copies planned)."""
    sched = engine.scheduler
    for msg in requests:
        assert sched.add_request(msg) is None
    tokens: dict[str, list[int]] = {}
    peak = copies = 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        copies += len(plan.copy_blocks)
        peak = max(peak, sched.state.kv.gpu.num_held)
        for out in plans.expanded(sched.update(plan, engine.runner.execute(plan))):
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        sched.check_invariants()
    assert sched.state.kv.gpu.num_held == 0
    return tokens, peak, copies


def add(rid: str, **sampling) -> AddRequest:
    return AddRequest(rid, PROMPT, SamplingParams(ignore_eos=True, **sampling), time.time())


def test_greedy_sequences_are_hf_greedy_and_share_the_prompt(tiny_engine, hf_greedy):
    engine = tiny_engine()
    tokens, peak, copies = run(engine, [add("g", n=3, temperature=0.0, max_tokens=6)])
    assert sorted(tokens) == ["g/0", "g/1", "g/2"]
    expected = hf_greedy(PROMPT, 6)
    assert all(tokens[f"g/{i}"] == expected for i in range(3)), tokens
    # Sequences 1 and 2 forked: the partial block (9 = P - 1 tokens cover 2 full blocks + 1) copied.
    assert copies == 2


def test_seeded_sequence_i_samples_what_a_single_request_with_seed_plus_i_samples(tiny_engine):
    seed = 2**64 - 2  # sequence 2 wraps around to seed 0
    sampling = dict(temperature=1.0, max_tokens=8)
    together, peak_group, _ = run(tiny_engine(), [add("s", n=3, seed=seed, **sampling)])
    alone = {}
    for i, s in enumerate([seed, seed + 1, 0]):
        got, _, _ = run(tiny_engine(), [add(f"one{i}", seed=s, **sampling)])
        alone[i] = got[f"one{i}"]
    assert [together[f"s/{i}"] for i in range(3)] == [alone[i] for i in range(3)]
    assert len({tuple(t) for t in alone.values()}) > 1  # the seeds do draw differently
    # The KV sharing happened: three separate requests arriving together hold more blocks.
    _, peak_separate, _ = run(
        tiny_engine(), [add(f"x{i}", seed=s, **sampling) for i, s in enumerate([seed, seed + 1, 0])]
    )
    assert peak_group < peak_separate, (peak_group, peak_separate)


def test_aborting_the_request_ends_every_sequence(tiny_engine):
    engine = tiny_engine()
    sched = engine.scheduler
    assert sched.add_request(add("a", n=4, temperature=1.0, max_tokens=20)) is None
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, engine.runner.execute(plan))
    outs = sched.abort(["a"])
    assert sorted(o.request_id for o in outs) == [f"a/{i}" for i in range(4)]
    assert not sched.has_work() and sched.state.kv.gpu.num_held == 0 and not sched.state.groups
    sched.check_invariants()


# ---------------------------------------------------------------- through conveyor.Engine's API


def test_engine_n3_greedy_is_hf_greedy_three_times(tiny_engine, hf_greedy):
    from tests.engine.conftest import run_all

    engine = tiny_engine()
    request = engine.add_request(token_ids=PROMPT, n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    changed = run_all(engine)
    assert all(r is request for out in changed for r in out.requests)  # the caller's request, never a sequence
    assert request.done and request.finish_reason == "length"
    expected = hf_greedy(PROMPT, 6)
    assert [s.index for s in request.outputs] == [0, 1, 2]
    assert all(s.tokens == expected and s.finish_reason == "length" for s in request.outputs)
    assert request.tokens == expected and engine.stats()["held_blocks"] == 0
    [result] = engine.generate([PROMPT], n=2, temperature=0.0, max_tokens=6, ignore_eos=True, progress=False)
    assert [o.token_ids for o in result.outputs] == [expected, expected] and result.token_ids == expected


def test_engine_seeded_sequences_are_single_requests_with_seed_plus_i(tiny_engine):
    engine = tiny_engine()
    seed = 2**64 - 2
    sampling = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone = [engine.generate([PROMPT], progress=False, seed=s, **sampling)[0] for s in (seed, seed + 1, 0)]
    [together] = engine.generate([PROMPT], progress=False, n=3, seed=seed, **sampling)
    assert [o.token_ids for o in together.outputs] == [a.token_ids for a in alone]
    assert [o.text for o in together.outputs] == [a.text for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) > 1


def test_engine_remove_of_an_n_request_frees_every_block(tiny_engine):
    engine = tiny_engine()
    request = engine.add_request(token_ids=PROMPT, n=4, temperature=1.0, max_tokens=50, ignore_eos=True)
    for _ in range(4):
        engine.step()
    assert engine.stats()["held_blocks"] > 0 and not request.done
    request.remove()
    assert request.done and request.finish_reason == "abort"
    assert all(s.finish_reason == "abort" for s in request.outputs)
    assert engine.stats()["held_blocks"] == 0 and not engine.has_pending_requests()
    engine.scheduler.check_invariants()


def test_engine_best_of_keeps_the_most_likely_sequences(tiny_engine):
    """best_of 3, n 2: the two of seeds seed, seed + 1, seed + 2 with the highest summed
    log-probability of their tokens (as single requests report them), most likely first."""
    engine = tiny_engine()
    seed = 2**64 - 2
    sampling = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    scored = []
    for s in (seed, seed + 1, 0):
        request = engine.add_request(token_ids=PROMPT, seed=s, logprobs=0, **sampling)
        while not request.done:
            engine.step()
        scored.append((sum(e.logprob for e in request.logprobs), request.tokens))
        request.remove()
    assert len({score for score, _ in scored}) == 3
    ranked = [tokens for _, tokens in sorted(scored, key=lambda x: -x[0])]
    [result] = engine.generate([PROMPT], progress=False, n=2, best_of=3, seed=seed, **sampling)
    assert [o.token_ids for o in result.outputs] == ranked[:2] and [o.index for o in result.outputs] == [0, 1]
    assert engine.stats()["held_blocks"] == 0


def test_engine_sequence_logprobs_are_single_requests_with_seed_plus_i(tiny_engine):
    """n = 3 with logprobs and prompt_logprobs: sequence i's log-probabilities are those of a
    single request with seed + i (token and top ids exactly; values to float32 rounding: the
    rows run in batches of other shapes, which changes the last bits on CPU); the prompt's
    are the request's, once, a single request's."""
    engine = tiny_engine()
    seed = 2**64 - 2
    sampling = dict(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    alone = []
    for s in (seed, seed + 1, 0):
        request = engine.add_request(token_ids=PROMPT, seed=s, **sampling)
        while not request.done:
            engine.step()
        alone.append(request)
        request.remove()
    together = engine.add_request(token_ids=PROMPT, n=3, seed=seed, **sampling)
    while not together.done:
        engine.step()
    assert len({tuple(a.tokens) for a in alone}) > 1
    for seq, single in zip(together.outputs, alone):
        assert seq.tokens == single.tokens
        assert_same_logprobs(seq.logprobs, single.logprobs)
        assert len(seq.logprobs) == 8 and all(len(e.top) == 3 for e in seq.logprobs)
    assert together.logprobs == together.outputs[0].logprobs  # the request's own: sequence 0's
    together.remove()
    [result] = engine.generate([PROMPT], progress=False, n=3, seed=seed, **sampling)  # the offline job's outputs
    assert [o.logprobs for o in result.outputs] == [s.logprobs for s in together.outputs]
    assert together.prompt_logprobs[0] is None and len(together.prompt_logprobs) == len(PROMPT)
    assert_same_logprobs(together.prompt_logprobs[1:], alone[0].prompt_logprobs[1:])
    assert engine.stats()["held_blocks"] == 0


def assert_same_logprobs(got, expected) -> None:
    """Entries of the same tokens and top tokens, with values equal to float32 rounding."""
    assert [(e.token_id, [t.token_id for t in e.top]) for e in got] == [
        (e.token_id, [t.token_id for t in e.top]) for e in expected
    ]
    flat = lambda entries: [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top))]  # noqa: E731
    assert flat(got) == pytest.approx(flat(expected), abs=1e-5)


def test_engine_prompt_logprobs_once_also_for_sequences_that_do_not_fork(tiny_engine):
    """Sequences that start after their leader ended (max_tokens 1) are admitted like any
    request; only the leader computes the prompt's log-probabilities, so they come once."""
    engine = tiny_engine()
    single = engine.add_request(token_ids=PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=1)
    while not single.done:
        engine.step()
    request = engine.add_request(token_ids=PROMPT, n=3, max_tokens=1, temperature=0.0, prompt_logprobs=1)
    while not request.done:
        engine.step()
    assert request.finish_reason == "length" and all(s.tokens == single.tokens for s in request.outputs)
    assert_same_logprobs(request.prompt_logprobs[1:], single.prompt_logprobs[1:])
