"""Speculative decoding in the scheduler, driven through the checking FakeWorker (which verifies
proposals greedily, as the real worker does): the batch-size rule (``speculative_max_batch``)
and the counters behind the acceptance metrics (``spec_*`` stats, vLLM's per-position counts).

Requests here cycle: the prompt is a phrase repeated and the worker continues the phrase, so
the n-gram proposer's lookups always hit and, unless the worker is told to deviate, are
accepted in full."""

from __future__ import annotations

from conveyor.ipc.messages import SchedulerStats, speculation_rates
from conveyor.runtime.config import SchedulerConfig
from tests.scheduler.scheduler_harness import Harness

PHRASE = 5  # tokens of each request's phrase


def phrase(request_id: str) -> list[int]:
    base = 10 + 10 * int(request_id[1:])
    return list(range(base, base + PHRASE))


def cycling(request_id: str, position: int) -> int:
    """The worker's token at ``position``: the request's phrase, continued."""
    return phrase(request_id)[position % PHRASE]


def deviating(request_id: str, position: int) -> int:
    """The phrase backwards: every lookup hits in the prompt, none predicts this token (for
    fewer than a phrase's length of outputs, before the output repeats itself)."""
    return phrase(request_id)[-position % PHRASE]


def harness(token_fn=cycling, k: int = 3, **overrides) -> Harness:
    config = dict(
        num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
        speculative_method="ngram", num_speculative_tokens=k, ngram_max=3, ngram_min=1,
    )  # fmt: skip
    config.update(overrides)
    return Harness(SchedulerConfig(**config), worker_kwargs={"token_fn": token_fn})


def add(h: Harness, request_id: str, max_tokens: int) -> None:
    h.add(request_id, prompt=phrase(request_id) * 2, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def proposing_decodes(h: Harness) -> list[tuple[int, int]]:
    """Per plan run: (its decode rows, of them verifying a proposal). Prompts here fit one
    step, so every row the worker already holds is a decode."""
    return [(len(plan.cached_requests), len(plan.cached_requests.spec_rows)) for plan in h.worker.plans]


def test_full_acceptance_counts_every_position_and_yields_k_plus_one_tokens_a_step():
    h = harness(k=3)
    add(h, "r1", max_tokens=17)
    add(h, "r2", max_tokens=17)
    h.run()
    h.check_outcomes()  # the tokens the requests would have had without speculation
    stats = h.scheduler.stats()
    SchedulerStats(query_id="q", **stats)
    # Step 1 prefills both (first token each); then 4 tokens a step: 16 more in 4 steps.
    assert stats["num_steps"] == 5
    assert stats["spec_num_steps"] == 4 and stats["spec_num_proposals"] == 8
    assert stats["spec_proposed_tokens"] == stats["spec_accepted_tokens"] == 8 * 3
    assert stats["spec_accepted_per_position"] == [8, 8, 8]
    assert speculation_rates(stats) == {
        "spec_acceptance_rate": 1.0,
        "spec_mean_acceptance_length": 4.0,
        "spec_proposals_per_step": 2.0,
    }


def test_rejections_count_no_accepted_positions():
    h = harness(token_fn=deviating, k=2)
    add(h, "r1", max_tokens=PHRASE)
    h.run()
    h.check_outcomes()
    stats = h.scheduler.stats()
    # Step 2 proposes, is rejected whole and backs off for step 3; step 4 proposes, cut to the
    # room left (step 5, the last token, has none).
    assert stats["num_steps"] == 5 and stats["spec_num_proposals"] == stats["spec_num_steps"] == 2
    assert stats["spec_proposed_tokens"] == 2 + 1
    assert stats["spec_accepted_tokens"] == 0 and stats["spec_accepted_per_position"] == [0, 0]
    rates = speculation_rates(stats)
    assert rates["spec_acceptance_rate"] == 0.0 and rates["spec_mean_acceptance_length"] == 1.0


def test_no_proposals_in_a_step_of_more_decodes_than_the_batch_rule_allows():
    h = harness(k=2, speculative_max_batch=2)
    add(h, "r1", max_tokens=4)  # finishes first: the batch falls to 2 decodes
    add(h, "r2", max_tokens=40)
    add(h, "r3", max_tokens=40)
    h.run()
    h.check_outcomes()
    seen = proposing_decodes(h)
    assert all(proposing == 0 for decodes, proposing in seen if decodes > 2), seen
    limited = sum(1 for decodes, _ in seen if decodes > 2)
    assert limited > 0 and any(proposing for decodes, proposing in seen if decodes <= 2), seen
    stats = h.scheduler.stats()
    assert stats["spec_num_limited_steps"] == limited
    assert stats["spec_accepted_tokens"] > 0


def test_the_batch_rule_off_lets_every_batch_propose():
    h = harness(k=2, speculative_max_batch=0)
    for i in range(1, 4):
        add(h, f"r{i}", max_tokens=10)
    h.run()
    h.check_outcomes()
    seen = proposing_decodes(h)
    assert any(decodes == 3 and proposing == 3 for decodes, proposing in seen), seen
    assert h.scheduler.stats()["spec_num_limited_steps"] == 0


def test_a_request_whose_proposals_all_miss_backs_off():
    """Outputs that walk the prompt with a stride of 7: every lookup hits (each token is in the
    prompt) and proposes its successor there, never the token that comes. Whole rejections
    in a row skip 1, 3, 7, then 15 decodes each, so of 40 decodes only decodes 1, 3, 7, 15
    and 31 propose, not all 40."""
    prompt = list(range(100, 150))

    def stride(request_id: str, position: int) -> int:
        return 100 + (7 * position) % 50

    h = harness(token_fn=stride, k=3)
    h.add("r1", prompt=prompt, max_tokens=41, temperature=0.0, ignore_eos=True)
    h.run()
    h.check_outcomes()
    stats = h.scheduler.stats()
    assert stats["spec_accepted_tokens"] == 0 and stats["num_steps"] == 41
    assert stats["spec_num_proposals"] == 5


def test_plans_ahead_while_every_request_backs_off_and_in_sync_while_one_may_propose():
    """With overlap, the scheduler plans ahead only while speculation is quiet: the plan in
    flight verifies nothing and every request that speculates is backing off. A plan formed
    ahead proposes nothing (its decodes' last tokens are pending) but counts the back-off, so
    the same five proposals are made as in sync, and the tokens are the same."""
    prompt = list(range(100, 150))

    def stride(request_id: str, position: int) -> int:
        return 100 + (7 * position) % 50

    h = harness(token_fn=stride, k=3)
    h.overlap = True
    h.add("r1", prompt=prompt, max_tokens=41, temperature=0.0, ignore_eos=True)
    h.run()
    h.check_outcomes()
    stats = h.scheduler.stats()
    assert stats["spec_num_proposals"] == 5 and stats["spec_accepted_tokens"] == 0
    ahead = [plan.planned_ahead for plan in h.worker.plans]
    assert sum(ahead) >= 20, ahead  # most of the 36 quiet decodes overlap the step before
    for plan, was_ahead in zip(h.worker.plans, ahead):
        assert not (was_ahead and plan.cached_requests.spec_rows), "a plan formed ahead proposed"
    # A request that may propose (a cycle, every proposal accepted) is planned in sync.
    h = harness(k=3)
    h.overlap = True
    add(h, "r1", max_tokens=17)
    h.run()
    h.check_outcomes()
    assert not any(plan.planned_ahead for plan in h.worker.plans[1:])
