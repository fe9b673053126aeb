"""Speculative decoding by a draft model at tensor parallelism 2 (gloo, CPU): the draft is
split over the ranks as the target is, rank 0 scores and picks each drafted token and
broadcasts it, so both ranks feed the same proposals to their shards. Each forked rank runs an
engine whose runner is that rank (as tests/engine/test_speculative_tensor_parallel.py). Greedy
outputs equal one process's and HF transformers', with the target as its own draft (swap and
recompute preemption, then a continued conversation over the cached prefix) and with a small
random draft; seeded sampled requests give the one-process tokens; a draft whose heads cannot
be split is refused before a weight loads. One start of two ranks runs every case."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, TINY, run_all
from tests.engine.test_speculative import _sampled, _serve
from tests.engine.test_speculative_draft import PRESSED, prompt
from tests.engine.test_speculative_tensor_parallel import rank_engine, run_ranks

PROMPTS = {f"r{i}": prompt(i) for i in range(5)}
MAX_TOKENS = 20
STATS = (
    "spec_proposed_tokens",
    "spec_accepted_tokens",
    "num_preemptions_swap",
    "num_preemptions_recompute",
    "held_blocks",
)
# case -> (draft: the target itself or the small one, preemption, proposal length)
GREEDY_CASES = {
    "self-swap": ("self", "swap", 3),
    "self-recompute": ("self", "recompute", 3),
    "small-swap": ("small", "swap", 4),
}


def draft_config(draft_dir: str, k: int, **config) -> dict:
    return dict(
        TINY, threads=1, speculative_method="draft", speculative_model=draft_dir, num_speculative_tokens=k, **config
    )


def run_cases(target: str, drafts: dict[str, str], tensor_parallel=None) -> dict:
    """Every case's outputs and counters, on ``tensor_parallel``'s rank (one process when None)."""
    results = {}
    for case, (draft, preemption, k) in GREEDY_CASES.items():
        engine = rank_engine(target, draft_config(drafts[draft], k, **PRESSED, preemption=preemption), tensor_parallel)
        outputs = _serve(engine, PROMPTS, MAX_TOKENS)
        results[case] = {"outputs": outputs, **{name: engine.stats()[name] for name in STATS}}
        if draft == "self":  # a continuation over the cached prefix: the draft's KV there is valid on each rank
            second = engine.add_request(token_ids=[40, 41, 40, 41], request_id="r4", max_tokens=12, **GREEDY)
            run_all(engine)
            results[case]["continued"] = (second.prompt_token_ids, second.tokens)
    engine = rank_engine(
        target, draft_config(drafts["small"], 3, max_batch_size=8, max_batch_tokens=32), tensor_parallel
    )
    results["sampled"] = {rid: request.tokens for rid, request in _sampled(engine, {}).items()}
    return results


def test_two_ranks_draft_as_one(tiny_checkpoint, draft_checkpoint, hf_greedy, tmp_path):
    drafts = {"self": str(tiny_checkpoint), "small": str(draft_checkpoint)}
    ranks = run_ranks(run_cases, 2, tmp_path, str(tiny_checkpoint), drafts)
    single = run_cases(str(tiny_checkpoint), drafts)
    for case, (draft, preemption, _) in GREEDY_CASES.items():
        one = single[case]
        assert one[f"num_preemptions_{preemption}"] > 0 and one["held_blocks"] == 0, (case, one)
        for rank in ranks:
            two = rank[case]
            assert two["outputs"] == one["outputs"], case
            assert two[f"num_preemptions_{preemption}"] > 0 and two["held_blocks"] == 0, (case, two)
            if draft == "self":  # nearly every proposal of the target's own greedy tokens is accepted
                assert two["spec_accepted_tokens"] >= 0.9 * two["spec_proposed_tokens"] > 0, (case, two)
                assert [list(part) for part in two["continued"]] == [list(part) for part in one["continued"]], case
            else:
                assert (
                    0 < two["spec_proposed_tokens"] and two["spec_accepted_tokens"] < 0.5 * two["spec_proposed_tokens"]
                )
        for rid, p in PROMPTS.items():
            assert one["outputs"][rid] == hf_greedy(p, MAX_TOKENS), (case, rid)
        if draft == "self":
            continued_prompt, continued = one["continued"]
            assert continued == hf_greedy(continued_prompt, 12), case
    assert ranks[0] == ranks[1]  # every rank returned rank 0's results
    assert ranks[0]["sampled"] == single["sampled"]  # the seeded streams of one process


def test_a_draft_whose_heads_cannot_be_split_is_refused_before_loading(tiny_checkpoint, tmp_path):
    import torch

    from conveyor.checkpoints.model_config import ModelConfig
    from conveyor.worker.attention.torch_ref import TorchReferenceAttention
    from conveyor.worker.draft_model import DraftModel
    from conveyor.worker.parallel import TensorParallel
    from tests.checkpoints import draft_checkpoint

    draft_checkpoint(tmp_path, tiny_checkpoint, num_attention_heads=3, hidden_size=48)
    target = ModelConfig.from_dir(tiny_checkpoint)
    with pytest.raises(
        ValueError,
        match=f"--speculative-model {tmp_path}: num_attention_heads 3 does not divide by the tensor-parallel size 2",
    ):
        DraftModel(
            tmp_path, target, torch.device("cpu"), torch.float32, TorchReferenceAttention(), 4, TensorParallel(1, 2)
        )
