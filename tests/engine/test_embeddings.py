"""Embeddings through ``conveyor.Engine``: pooling requests (last and mean) equal HF
transformers' final hidden states pooled the same way, chunked prefill included; they
batch with generations in the same steps, take no decode step and hold no KV afterwards."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, run_all

# Prompt lengths around the chunk budget below: the long ones are prefilled in several chunks.
LENGTHS = (1, 5, 17, 40, 77)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * n) % 200 + 5 for i in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers(tiny_engine, hf_pooled, pooling):
    import torch

    engine = tiny_engine(max_num_batched_tokens=16)  # the 40- and 77-token prompts run in chunks
    prompts = _prompts()
    vectors = engine.embed(prompts, pooling=pooling)
    assert len(vectors) == len(prompts)
    for tokens, vector in zip(prompts, vectors):
        ours = torch.tensor(vector)
        ref = hf_pooled(tokens, pooling)
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=1e-4), (len(tokens), (ours - ref).abs().max())
        assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) > 0.9999
    # Again: their blocks are in the prefix cache now, but a pooling request takes no hit
    # (every position's hidden state is pooled), so the vectors are the same.
    again = engine.add_request(token_ids=prompts[-1], pooling=pooling, max_tokens=1)
    run_all(engine)
    assert again.num_cached_tokens == 0 and torch.allclose(
        torch.tensor(again.embedding), torch.tensor(vectors[-1]), atol=1e-5
    )
    stats = engine.stats()
    assert stats["held_blocks"] == 0 and stats["cached_blocks"] > 0, stats


def test_embeddings_batch_with_generation(tiny_engine, hf_pooled, hf_greedy):
    """Embedding requests join the steps of running generations: each step that runs an
    embedding's prompt also runs a decode; the generations' tokens are transformers' greedy
    ones and the vectors transformers' pooled ones; no block is held at the end."""
    import torch

    engine = tiny_engine(max_num_batched_tokens=16)
    prompt = [11, 12, 13, 14, 15, 16]
    gen = engine.add_request(token_ids=prompt, max_tokens=12, **GREEDY)
    engine.step()  # its prefill: it decodes from now on
    embeds = [engine.add_request(token_ids=tokens, pooling="mean", max_tokens=1) for tokens in _prompts()[2:]]
    outs = []
    while engine.has_pending_requests():
        outs.append(engine.step())
        engine.scheduler.check_invariants()
    mixed = [o for o in outs if o.batch is not None and o.batch.decode_tokens and o.batch.prefill_tokens]
    assert mixed, "no step ran a decode beside an embedding's prompt"
    assert gen.tokens == hf_greedy(prompt, 12)
    for request, tokens in zip(embeds, _prompts()[2:]):
        assert request.finish_reason == "stop" and request.tokens == []
        assert torch.allclose(torch.tensor(request.embedding), hf_pooled(tokens, "mean"), atol=1e-4)
    assert engine.stats()["held_blocks"] == 0


def test_pooling_refusals(tiny_engine):
    engine = tiny_engine()
    with pytest.raises(ValueError, match="'pooling' must be one of"):
        engine.embed([[1, 2, 3]], pooling="max")
    with pytest.raises(ValueError, match="a pooling request samples none"):
        engine.add_request(token_ids=[1, 2, 3], pooling="last", n=2)
    with pytest.raises(ValueError, match="a pooling request samples none"):
        engine.add_request(token_ids=[1, 2, 3], pooling="last", logprobs=1)


def test_preempted_pooling_request_starts_over(tiny_engine, hf_pooled):
    """A mean-pooling request preempted mid-prefill (a higher-priority generation needs its
    blocks) is recomputed from its first token, never swapped (its running sum lives with its
    slot), even on a server that swaps: its vector is still transformers' mean."""
    import torch

    engine = tiny_engine(
        num_kv_blocks=24, max_num_batched_tokens=16, policy="priority", preemption="swap", num_cpu_blocks=64
    )
    long = _prompts()[-1]  # 77 tokens: 20 blocks of 4
    embed = engine.add_request(token_ids=long, pooling="mean", max_tokens=1)
    engine.step()
    engine.step()  # two chunks of it are in
    prompt = [(3 * i) % 90 + 21 for i in range(40)]
    gen = engine.add_request(token_ids=prompt, max_tokens=24, priority=10, **GREEDY)
    run_all(engine)
    stats = engine.stats()
    assert stats["num_preemptions_recompute"] >= 1 and stats["num_preemptions_swap"] == 0, stats
    assert len(gen.tokens) == 24
    assert torch.allclose(torch.tensor(embed.embedding), hf_pooled(long, "mean"), atol=1e-4)
    assert stats["held_blocks"] == 0 and stats["swapped_blocks"] == 0
