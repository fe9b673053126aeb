"""Gemma 3 through ``conveyor.Engine`` end to end: a tiny random Gemma 3 (tests/checkpoints.py:
sliding window 6 around a global layer, own rope bases, GeGLU, sandwich norms, capped
logits) with the demo tokenizer. A batch of prompts of different lengths, all longer than
the window, run together through chunked prefill and continuous batching: greedy tokens
equal transformers' generate, token log-probabilities its float32 log-softmax."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import GREEDY, TINY, run_all

WINDOW = 6


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """``(checkpoint dir, HF model)``."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import gemma3_serving_checkpoint

    directory = gemma3_serving_checkpoint(tmp_path_factory.mktemp("tiny-gemma3"))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return directory, model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def test_a_batch_through_chunked_prefill_matches_transformers(gemma3):
    from conveyor import Engine

    directory, model = gemma3
    engine = Engine(directory, **{**TINY, "max_batch_tokens": 16, "max_batch_size": 16})
    assert engine.model_config.architecture == "Gemma3ForCausalLM"
    generator = torch.Generator().manual_seed(5)
    lengths = [7, 9, 13, 18, 25, 31, 40, 11]  # all past the window; several past the 16-token budget
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    requests = [engine.add_request(token_ids=prompt, max_tokens=8, logprobs=2, **GREEDY) for prompt in prompts]
    batches = [out.batch for out in run_all(engine)]
    assert min(lengths) > WINDOW
    assert max(b.batch_size for b in batches if b) >= 4 and any(
        b.prefill_tokens and b.decode_tokens for b in batches if b
    )
    for prompt, request in zip(prompts, requests):
        assert request.tokens == hf_greedy(model, prompt, 8), len(prompt)
        with torch.inference_mode():
            ref = model(torch.tensor([prompt + request.tokens])).logits[0].float().log_softmax(-1)
        for i, entry in enumerate(request.logprobs):
            row = ref[len(prompt) + i - 1]
            assert entry.logprob == pytest.approx(row[request.tokens[i]].item(), abs=1e-4)
            assert [t.logprob for t in entry.top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    assert not engine.has_pending_requests() and engine.stats()["held_blocks"] == 0
