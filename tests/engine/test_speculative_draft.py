"""Speculative decoding with a draft model (``speculative_method="draft"``) through the engine:
greedy output equals plain greedy and HF transformers' token for token, with the target itself
as the draft (nearly every proposal accepted) and with a smaller random draft of the same
vocabulary (few accepted), through chunked prefill, swap and recompute preemption, the prefix
cache and a continued conversation; a bad draft is refused at start with a clear error."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, run_all
from tests.engine.test_speculative import _sampled, _serve


def prompt(i: int) -> list[int]:
    return [(11 * i + 7 * j) % 4000 + 5 for j in range(9 + 3 * i)]


# Few blocks and a small budget: chunked prefills beside speculating decodes, and preemptions.
PRESSED = dict(max_batch_size=4, max_batch_tokens=14, num_kv_blocks=16, num_cpu_blocks=64)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_target_as_its_own_draft_accepts_nearly_all_and_stays_exact(
    tiny_engine, tiny_checkpoint, hf_greedy, preemption
):
    prompts = {f"r{i}": prompt(i) for i in range(5)}
    spec_engine = tiny_engine(
        **PRESSED,
        preemption=preemption,
        speculative_method="draft",
        speculative_model=str(tiny_checkpoint),
        num_speculative_tokens=3,
    )
    spec = _serve(spec_engine, prompts, 20)
    stats = spec_engine.stats()
    for rid, p in prompts.items():
        assert spec[rid] == hf_greedy(p, 20), rid
    assert stats[f"num_preemptions_{preemption}"] > 0, "the run was to preempt"
    assert stats["spec_num_proposals"] > 0
    # The draft is the target: every proposal is the target's own greedy continuation (float
    # ties aside), so nearly every proposed token is accepted.
    assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"], stats
    assert stats["num_steps"] < sum(len(t) for t in spec.values()) / 2, "steps were to yield several tokens"
    assert stats["held_blocks"] == 0

    # A continued conversation (of the request that finished last: its blocks are still cached)
    # reuses the cached prefix, whose draft KV must be valid too: the draft still agrees.
    before = spec_engine.stats()
    second = spec_engine.add_request(token_ids=[40, 41, 40, 41], request_id="r4", max_tokens=12, **GREEDY)
    run_all(spec_engine)
    after = spec_engine.stats()
    assert second.prompt_token_ids == prompts["r4"] + spec["r4"] + [40, 41, 40, 41]
    assert second.tokens == hf_greedy(second.prompt_token_ids, 12)
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] >= 0.9 * proposed > 0


def test_a_different_draft_is_mostly_rejected_and_stays_exact(tiny_engine, draft_checkpoint, hf_greedy):
    prompts = {f"r{i}": prompt(i) for i in range(5)}
    spec_engine = tiny_engine(
        **PRESSED,
        preemption="swap",
        speculative_method="draft",
        speculative_model=str(draft_checkpoint),
        num_speculative_tokens=4,
    )
    spec = _serve(spec_engine, prompts, 16)
    stats = spec_engine.stats()
    plain = _serve(tiny_engine(**PRESSED, preemption="swap"), prompts, 16)
    for rid, p in prompts.items():
        assert spec[rid] == plain[rid] == hf_greedy(p, 16), rid
    assert stats["spec_proposed_tokens"] > 0
    assert stats["spec_accepted_tokens"] < 0.5 * stats["spec_proposed_tokens"], stats
    assert stats["held_blocks"] == 0


def test_bad_draft_models_are_refused_at_start(tiny_engine, tiny_checkpoint, tmp_path):
    from conveyor.runtime.model_source import StartupError
    from tests.checkpoints import draft_checkpoint, make_checkpoint

    with pytest.raises(StartupError, match="speculative-model .*no config.json"):
        tiny_engine(speculative_method="draft", speculative_model=str(tmp_path), num_speculative_tokens=2)
    make_checkpoint("llama", tmp_path)  # a vocabulary of 320 tokens
    with pytest.raises(ValueError, match="320 tokens, the served model's 4096"):
        tiny_engine(speculative_method="draft", speculative_model=str(tmp_path), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="go together"):
        tiny_engine(speculative_method="draft", num_speculative_tokens=2)
    short = tmp_path / "short"
    short.mkdir()
    draft_checkpoint(short, tiny_checkpoint, max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_position_embeddings 64 is below the served max_model_len 256"):
        tiny_engine(speculative_method="draft", speculative_model=str(short), num_speculative_tokens=2)
    tiny_engine(speculative_method="draft", speculative_model=str(short), num_speculative_tokens=2, max_model_len=64)


def test_plans_carry_draft_counts_the_draft_proposes_its_greedy_tokens_and_keeps_their_probabilities(
    tiny_engine, tiny_checkpoint, hf_greedy, monkeypatch
):
    import torch

    from conveyor.worker.plan_check import PlanRefused

    engine = tiny_engine(speculative_method="draft", speculative_model=str(tiny_checkpoint), num_speculative_tokens=3)
    engine.add_request(token_ids=prompt(1), request_id="a", max_tokens=8, **GREEDY)
    engine.step()  # the prefill
    plan = engine.scheduler.schedule()
    cached = plan.cached_requests
    assert (cached.spec_rows, cached.spec_draft_counts, cached.spec_token_ids) == ([0], [3], [])
    assert list(cached.num_scheduled_tokens) == [4]
    with pytest.raises(PlanRefused, match="no draft model"):
        tiny_engine().runner.launch(plan)

    # The draft is the target: it drafts the target's next greedy tokens, which are all accepted.
    proposals = []
    propose = engine.runner.draft.propose
    monkeypatch.setattr(engine.runner.draft, "propose", lambda *args: proposals.append(propose(*args)) or proposals[-1])
    launched = engine.runner.launch(plan)
    result = engine.runner.finish(launched)
    expected = hf_greedy(prompt(1), 5)  # expected[0] was sampled by the prefill
    [drafts] = proposals
    assert drafts.tokens.tolist() == expected[1:4] and drafts.counts == [3]
    assert launched.spec_proposals == [tuple(expected[1:4])]
    assert drafts.probs.shape == (3, engine.model_config.vocab_size)
    assert torch.equal(drafts.probs.argmax(dim=-1), drafts.tokens)
    torch.testing.assert_close(drafts.probs.sum(dim=-1), torch.ones(3))
    assert list(result.sampled_token_ids) == [expected[1]] and result.spec_token_ids == [expected[2:5]]


@pytest.mark.parametrize("draft", ["self", "small"])
def test_sampled_requests_keep_their_seeded_stream_with_a_draft(tiny_engine, tiny_checkpoint, draft_checkpoint, draft):
    """The draft proposes its argmax, so verification treats its proposals as point masses, as
    the n-gram proposer's: a seeded sampled request emits its plain stream (every filter). A
    parallel-sampling request beside them (never speculates; its forks copy blocks in both
    caches) is unchanged too."""
    model = tiny_checkpoint if draft == "self" else draft_checkpoint
    config = dict(max_batch_size=8, max_batch_tokens=32)
    pair = {"pair": dict(token_ids=prompt(2), max_tokens=8, temperature=0.7, seed=5, n=2)}
    spec_engine = tiny_engine(
        **config, speculative_method="draft", speculative_model=str(model), num_speculative_tokens=3
    )
    spec = _sampled(spec_engine, pair)
    stats = spec_engine.stats()
    plain = _sampled(tiny_engine(**config), pair)
    for rid, request in plain.items():
        assert [s.tokens for s in spec[rid].outputs] == [s.tokens for s in request.outputs], rid
    assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats  # sampled: some rejected
    assert draft == "small" or stats["spec_accepted_tokens"] > 0, stats


@pytest.mark.gpu
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_cuda_draft_speculation_equals_hf(tiny_engine, tiny_checkpoint, draft_checkpoint, hf_greedy, preemption):
    """On CUDA in float32 (Triton attention; plain decode steps on CUDA graphs, drafting and
    verifying steps eager): greedy output equals HF's with either draft, through preemption."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = {f"r{i}": prompt(i) for i in range(5)}
    for model in (tiny_checkpoint, draft_checkpoint):
        engine = tiny_engine(
            **PRESSED, device="cuda", dtype="float32", preemption=preemption,
            speculative_method="draft", speculative_model=str(model), num_speculative_tokens=3,
        )  # fmt: skip
        spec = _serve(engine, prompts, 20)
        stats = engine.stats()
        for rid, p in prompts.items():
            assert spec[rid] == hf_greedy(p, 20), (model, rid)
        assert stats[f"num_preemptions_{preemption}"] > 0 and stats["spec_proposed_tokens"] > 0
        assert model != tiny_checkpoint or stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"], stats
