"""Mixture-of-experts models through ``conveyor.Engine`` end to end: tiny random Qwen3-MoE and
Mixtral checkpoints with the demo tokenizer (tests/checkpoints.py), greedy tokens equal to
transformers' through every scheduler path the dense models take: chunked prefill beside
decodes, recompute and swap preemption, the prefix cache, n > 1, n-gram speculative decoding,
log-probabilities (equal to transformers' float32 log-softmax) and structured output; LoRA on
the attention projections equal to PEFT, LoRA on the experts refused with a clear error."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tests.engine.conftest import GREEDY, TINY, run_all
from tests.engine.test_speculative import SPEC, repetitive
from tests.engine.test_structured import SCHEMA, json_schema

pytest.importorskip("llguidance")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """``(checkpoint dir, HF model, greedy(prompt, n), log_softmax(tokens))``."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import moe_serving_checkpoint

    directory = moe_serving_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    def greedy(prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return out[0, len(prompt) :].tolist()

    def log_softmax(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)

    return directory, model, greedy, log_softmax


def engine_of(directory, **config):
    from conveyor import Engine

    return Engine(directory, **{**TINY, **config})


def echoed(greedy, n: int, count: int = 4) -> list[list[int]]:
    """``count`` repetitive prompts whose greedy continuation of ``n`` tokens repeats a token
    of its context: an n-gram proposer finds proposals there (a random model's continuation
    of most prompts never does, and then no step would verify anything)."""
    found = []
    for i in range(40):
        prompt = repetitive(i)
        tokens = greedy(prompt, n)
        if any(token in prompt + tokens[:j] for j, token in enumerate(tokens[: n - 3])):
            found.append(prompt)
        if len(found) == count:
            return found
    raise AssertionError(f"only {len(found)} of 40 prompts have continuations that repeat their context")


def test_speculative_greedy_through_chunks_and_preemption_equals_transformers(moe):
    """Qwen3-MoE preempted by recompute, Mixtral by swap (each kind once: the runs are the
    module's slowest)."""
    directory, model, greedy, _ = moe
    preemption = {"qwen3_moe": "recompute", "mixtral": "swap"}[model.config.model_type]
    prompts = {f"r{i}": p for i, p in enumerate(echoed(greedy, 14))}
    config = dict(max_batch_size=4, max_batch_tokens=12, num_kv_blocks=20, preemption=preemption, swap_space=0.01)
    engine = engine_of(directory, **config, **SPEC)
    requests = {
        rid: engine.add_request(token_ids=p, request_id=rid, max_tokens=14, **GREEDY) for rid, p in prompts.items()
    }
    run_all(engine)
    stats = engine.stats()
    assert stats[f"num_preemptions_{preemption}"] > 0 and stats["spec_proposed_tokens"] > 0, stats
    assert stats["held_blocks"] == 0
    for rid, prompt in prompts.items():
        assert requests[rid].tokens == greedy(prompt, 14), rid


def test_prefix_cache_n_sequences_and_logprobs_equal_transformers(moe):
    directory, _, greedy, log_softmax = moe
    engine = engine_of(directory, max_batch_tokens=16)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 300, (21,), generator=generator).tolist()
    first = engine.add_request(token_ids=prompt, max_tokens=6, logprobs=2, **GREEDY)
    run_all(engine)
    again = engine.add_request(token_ids=prompt + [9, 10], max_tokens=6, n=2, **GREEDY)
    run_all(engine)
    assert again.num_cached_tokens > 0, "the repeated prompt took nothing from the prefix cache"
    assert first.tokens == greedy(prompt, 6)
    assert [out.tokens for out in again.outputs] == [greedy(prompt + [9, 10], 6)] * 2
    ref = log_softmax(prompt + first.tokens)
    for i, entry in enumerate(first.logprobs):
        row = ref[len(prompt) + i - 1]
        assert entry.logprob == pytest.approx(row[first.tokens[i]].item(), abs=1e-4)
        assert [t.logprob for t in entry.top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    assert engine.stats()["held_blocks"] == 0


def test_structured_output_beside_free_rows(moe):
    directory, _, greedy, _ = moe
    engine = engine_of(directory, max_batch_size=8)
    free = engine.add_request(token_ids=[5, 17, 29, 41, 53], max_tokens=10, **GREEDY)
    constrained = [
        engine.add_request(prompt=f"person {i}:", max_tokens=120, temperature=t, seed=i, constraint=json_schema())
        for i, t in enumerate([0.0, 1.0])
    ]  # fmt: skip
    run_all(engine)
    assert free.tokens == greedy([5, 17, 29, 41, 53], 10)
    for request in constrained:
        assert request.finish_reason == "stop", request
        jsonschema.validate(json.loads(request.text), SCHEMA)
    assert engine.stats()["held_blocks"] == 0


def test_attention_lora_equals_peft_and_expert_lora_is_refused(moe, tmp_path):
    from conveyor.worker.lora import LoraLoadError
    from tests.lora_adapters import make_adapter

    directory, model, greedy, _ = moe
    peft = make_adapter(model, tmp_path / "attn", seed=3, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    engine = engine_of(directory, lora_modules={"attn": str(tmp_path / "attn")})
    prompt = [7, 9, 11, 13, 15, 17]
    with_lora = engine.add_request(token_ids=prompt, max_tokens=8, lora="attn", **GREEDY)
    base = engine.add_request(token_ids=prompt, max_tokens=8, **GREEDY)
    run_all(engine)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        want = peft.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    assert with_lora.tokens == want[0, len(prompt) :].tolist() != base.tokens == greedy(prompt, 8)

    expert_adapter = tmp_path / "experts"
    (tmp_path / "attn").rename(expert_adapter)
    config = json.loads((expert_adapter / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "gate_proj", "up_proj"]
    (expert_adapter / "adapter_config.json").write_text(json.dumps(config))
    engine = engine_of(directory, enable_lora=True)
    with pytest.raises(LoraLoadError, match="LoRA on a mixture-of-experts model's experts .* is not supported"):
        engine.load_lora("experts", expert_adapter)


def test_two_ranks_with_the_experts_split_equal_transformers(moe):
    """``Engine(tensor_parallel_size=2, expert_parallel=True)``: rank 1 a worker process holding
    the other half of the experts (bin/serve's worker entry), a batch through chunked prefill."""
    directory, _, greedy, _ = moe
    engine = engine_of(directory, threads=1, max_batch_tokens=12, tensor_parallel_size=2, expert_parallel=True,
                       distributed_timeout_s=60)  # fmt: skip
    try:
        prompts = [repetitive(i) for i in range(3)]
        requests = [engine.add_request(token_ids=p, max_tokens=8, **GREEDY) for p in prompts]
        run_all(engine)
        assert engine.runner.model.layers[0].mlp.shard.count == engine.model_config.moe.num_experts // 2
        for prompt, request in zip(prompts, requests):
            assert request.tokens == greedy(prompt, 8)
    finally:
        engine.close()
