"""Pooling requests (embeddings) in the continuous batcher, driven through the checking
FakeWorker: prompt-only, they run their prompt in chunks beside the decodes of generations
(planned ahead too, a last chunk of one token included), sample nothing, finish with the
worker's vector as ``stop``, take no prefix-cache hit, are preempted by recompute even where
the policy would swap, and leave no block held."""

from __future__ import annotations

import pytest

from tests.scheduler.fake_worker import pooled_vector
from tests.scheduler.scenario_helpers import cfg
from tests.scheduler.scheduler_harness import Harness, make_prompt


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "prompt_len", [1, 9, 16, 31]
)  # 16, 31: a last chunk of one token (15 a step beside the decode)
def test_pooling_requests_finish_with_their_vector_beside_decodes(overlap, prompt_len):
    h = Harness(cfg(max_num_batched_tokens=16, num_blocks=64), overlap=overlap)
    h.add("gen", prompt_len=5, max_tokens=40)
    h.step()
    h.add("emb", prompt_len=prompt_len, pooling="mean")
    h.add("emb2", prompt_len=prompt_len + 3, pooling="last")
    for _ in range(8):  # 36 prompt tokens at most, 16 a step beside one decode: done while gen decodes
        h.step()
    assert {"emb", "emb2"} <= set(h.final) and "gen" not in h.final
    h.run()
    for key in ("emb", "emb2"):
        final = h.final[key]
        assert final.finish_reason == "stop" and h.tokens.get(key, []) == [], key
        assert final.embedding == pooled_vector(h.prompts[key])
        assert final.first_token_time is not None
    assert len(h.tokens["gen"]) == 40 and h.final["gen"].finish_reason == "length"
    # Every pooling row ran its prompt exactly once, and never sampled.
    ran = {key: sum(step.get(key, 0) for step in h.worker.scheduled) for key in ("emb", "emb2")}
    assert ran == {"emb": prompt_len, "emb2": prompt_len + 3}
    assert any("emb" in step and "gen" in step for step in h.worker.scheduled), "not batched with the decodes"


def test_pooling_request_takes_no_prefix_hit():
    h = Harness(cfg(num_blocks=64))
    prompt = make_prompt("shared", 24)
    h.add("gen", prompt=prompt, max_tokens=2)
    h.run()
    h.add("emb", prompt=prompt, pooling="last")
    h.run()
    assert h.final["emb"].num_cached_tokens == 0 and h.final["emb"].embedding == pooled_vector(prompt)
    assert h.scheduler.state.kv.gpu.num_cached > 0  # the cache held the prefix: it was not taken


def test_preempted_pooling_request_is_recomputed_not_swapped():
    h = Harness(
        cfg(
            policy="priority",
            aging_rate=0.0,
            num_blocks=12,
            num_cpu_blocks=32,
            preemption="swap",
            max_num_batched_tokens=8,
        )
    )
    h.add("emb", prompt_len=40, pooling="mean", priority=0)
    h.step()
    h.step()
    h.add("vip", prompt_len=8, max_tokens=30, priority=9)
    h.run()
    assert h.final["emb"].embedding == pooled_vector(h.prompts["emb"])
    assert h.worker.num_computed_at_arrival["emb"] == [0, 0]  # taken in twice, from its first token each time
    stats = h.scheduler.stats()
    assert stats["num_preemptions_recompute"] >= 1 and stats["num_preemptions_swap"] == 0, stats
