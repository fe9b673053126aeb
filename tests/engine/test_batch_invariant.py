"""Batch-invariant mode: a request's tokens and log-probabilities are the same bits whatever else
runs beside it (docs/architecture.md, "Batch-invariant mode").

One target request (greedy, or seeded sampling) is served alone on a fresh engine: the
reference. Hypothesis then draws the company it keeps on engines that cut and move its work
differently (a tiny token budget chunking its prefill, a pool small enough to preempt it by
recomputation or by swapping, n-gram speculation verifying several rows of it per step,
companions sharing its prefix so that it hits the prefix cache) and every draw must give the
reference's tokens and top log-probabilities bit for bit. The same draws with the mode off
must differ at least once: otherwise the property test would prove nothing.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.conftest import TINY
from tests.engine.test_speculative import repetitive

_rng = random.Random(0)
#: A phrase said five times: n-gram speculation finds drafts in it.
TARGET = [_rng.randrange(5, 300) for _ in range(8)] * 5
#: Companions each engine always runs beside the drawn ones: for the n-gram engine, phrases
#: repeated, whose drafts this checkpoint accepts; for the small pools, enough to preempt.
ALWAYS = {
    "ngram": [(repetitive(i), 12) for i in range(4)],
    "chunked-recompute": [([9 + i] * 30, 12) for i in range(2)],
    "swap": [([9 + i] * 30, 12) for i in range(2)],
}
#: The target's sampling: greedy or seeded sampling (the key of each draw is the request's own),
#: with its top 5 log-probabilities; or greedy without them, which n-gram speculation verifies
#: (a request asking for log-probabilities does not speculate).
SAMPLINGS = {
    "greedy": dict(temperature=0.0, logprobs=5),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=7, logprobs=5),
    "speculating": dict(temperature=0.0),
}
#: Engines that cut the target's work differently: its prefill in 7-token chunks beside
#: recompute preemptions; 33-token chunks and swap preemptions; n-gram speculation.
ENGINES = {
    "chunked-recompute": dict(max_num_batched_tokens=7, num_kv_blocks=18, preemption="recompute", max_num_seqs=16),
    "swap": dict(max_num_batched_tokens=33, num_kv_blocks=18, preemption="swap", num_cpu_blocks=256, max_num_seqs=16),
    "ngram": dict(
        max_num_batched_tokens=64, speculative_method="ngram", num_speculative_tokens=3, ngram_max=3, ngram_min=1
    ),
}

company = st.lists(
    st.tuples(st.lists(st.integers(5, 299), min_size=1, max_size=60), st.integers(1, 12)), min_size=1, max_size=6
)
draws = st.tuples(
    st.sampled_from(sorted(SAMPLINGS)),
    company,
    st.integers(0, 6),  # how many companions are queued before the target
    st.one_of(st.none(), st.integers(4, 40)),  # a companion sharing the target's first tokens
)


def _serve_target(engine, sampling: str, companions, before: int, shared: int | None):
    """Queue the companions and the target, run until all end; the target's tokens and, per
    token, its log-probability and its top 5 (ids and log-probabilities)."""
    if shared is not None:
        companions = [*companions, (TARGET[:shared] + [1, 2, 3], 4)]
    added = []
    for i, (prompt, max_tokens) in enumerate(companions):
        if i == before:
            added.append(None)
        added.append((prompt, max_tokens))
    if len(added) == len(companions):
        added.append(None)
    target = None
    for item in added:
        if item is None:
            target = engine.add_request(token_ids=TARGET, max_tokens=10, ignore_eos=True, **SAMPLINGS[sampling])
        else:
            engine.add_request(token_ids=item[0], max_tokens=item[1], ignore_eos=True, temperature=0.0)
    while engine.has_pending_requests():
        engine.step()
    entries = [(e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in target.logprobs or []]
    return target.tokens, entries


class Served:
    """The engines of one mode, made on first use, and the target alone: the reference."""

    def __init__(self, checkpoint, batch_invariant: bool) -> None:
        self.checkpoint, self.batch_invariant = checkpoint, batch_invariant
        self.engines: dict[str, object] = {}
        alone = self._engine({})
        self.reference = {s: _serve_target(alone, s, [], 0, None) for s in SAMPLINGS}

    def _engine(self, config):
        from conveyor import Engine

        return Engine(self.checkpoint, **{**TINY, "num_kv_blocks": 256, **config}, batch_invariant=self.batch_invariant)

    def engine(self, name: str):
        if name not in self.engines:
            self.engines[name] = self._engine(ENGINES[name])
        return self.engines[name]

    def matches(self, draw) -> bool:
        name, sampling, companions, before, shared = draw
        companions = [*companions, *ALWAYS[name]]
        return _serve_target(self.engine(name), sampling, companions, before, shared) == self.reference[sampling]


@pytest.fixture(scope="module")
def invariant(tiny_checkpoint):
    return Served(tiny_checkpoint, batch_invariant=True)


@pytest.mark.parametrize("name", sorted(ENGINES))
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draw=draws)
def test_a_request_is_the_same_bits_in_any_company(invariant, name, draw):
    assert invariant.matches((name, *draw)), draw


def test_the_draws_exercised_what_they_claim(invariant):
    """The property test's engines did preempt (both ways), chunk, speculate and hit the cache."""
    stats = {name: engine.stats() for name, engine in invariant.engines.items()}
    assert set(stats) == set(ENGINES)
    assert stats["chunked-recompute"]["num_preemptions"] > 0
    assert stats["swap"]["num_preemptions"] > 0
    assert stats["ngram"]["spec_accepted_tokens"] > 0
    assert sum(s["prefix_cache_hit_tokens"] for s in stats.values()) > 0
    assert all(s["held_blocks"] == 0 for s in stats.values()), stats


def test_without_the_mode_some_company_changes_the_bits(tiny_checkpoint):
    """The same kind of draws, mode off: at least one changes the target's bits (else the
    property above would hold by accident of the checkpoint, and prove nothing)."""
    plain = Served(tiny_checkpoint, batch_invariant=False)
    rng = random.Random(1)
    for _ in range(6):
        companions = [
            ([rng.randrange(5, 300) for _ in range(rng.randint(1, 60))], rng.randint(1, 12)) for _ in range(5)
        ]
        if not plain.matches(("chunked-recompute", "greedy", companions, 2, None)):
            return
    pytest.fail("six draws in a row matched without batch-invariant mode")


def test_sampled_tokens_logprobs_equal_a_trainers_single_sequence_forward(invariant, hf_logprobs):
    """The training-inference check: the log-probabilities served with the sampled tokens equal,
    bit for bit, a single-sequence forward over prompt + output (the trainer's view, here the
    engine's own prefill of the whole sequence), and HF's float32 forward within 1e-5."""
    engine = invariant.engine("chunked-recompute")
    served = engine.add_request(token_ids=TARGET, max_tokens=10, ignore_eos=True, logprobs=0, temperature=0.9, seed=3)
    for prompt, max_tokens in ALWAYS["chunked-recompute"]:
        engine.add_request(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    while engine.has_pending_requests():
        engine.step()
    sequence = TARGET + served.tokens
    scored = engine.add_request(token_ids=sequence, max_tokens=1, prompt_logprobs=0, temperature=0.0)
    while engine.has_pending_requests():
        engine.step()
    forward = [entry.logprob for entry in scored.prompt_logprobs[len(TARGET) :]]
    assert forward == [entry.logprob for entry in served.logprobs]
    reference = hf_logprobs(sequence)
    for position, (token, logprob) in enumerate(zip(served.tokens, forward), start=len(TARGET) - 1):
        assert abs(logprob - reference[position, token].item()) < 1e-5
