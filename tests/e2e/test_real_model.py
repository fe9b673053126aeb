"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers on the same file.

The file is fetched by the product's own fetch (cached: a fresh machine downloads it once) and
served through its cached checkpoint directory. transformers loads the same GGUF, dequantized
to float32, as the reference: 16 chat prompts sent at once, through chunked prefill (32 tokens
an iteration: every prompt is longer) and preemption of a small KV pool, must get its greedy
tokens; the top-20 log-probabilities must be its log-softmax within 1e-4; the chat template
must render as ``apply_chat_template``. The weights are served dequantized to float32
(``quantization="none"``), as transformers loads them; ``auto`` would keep the file quantized.

transformers checks the greedy tokens teacher-forced: one forward over each prompt and our
output gives its next-token logits at every step, and our tokens are its greedy tokens exactly
when each is the argmax there (then ``generate`` would pick them one by one). One batched
forward instead of 16 generate loops keeps the module within its time on 2 shared cores;
right padding leaves every real position's logits as they are (causal attention).
"""

from __future__ import annotations

import pytest
import torch

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is 12 plus 30?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What gas do plants absorb from the air?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into Spanish.",
    "What is the largest planet in the solar system?",
    "List two uses of a paperclip.",
    "Why is the sky blue? Answer in one sentence.",
    "What comes after Tuesday?",
    "Spell the word 'necessary' backwards.",
    "What is the square root of 81?",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(real_model_dir):
    """The engine (chunked prefill, a KV pool too small for all 16 at once), its 16 greedy
    chat results with top-20 log-probabilities, and its preemption count."""
    from conveyor import Engine

    with Engine(
        str(real_model_dir), device="cpu", quantization="none", threads=1, block_size=8, num_kv_blocks=28,
        max_num_batched_tokens=32,
        preemption="recompute",
    ) as engine:  # fmt: skip
        results = engine.generate(chats(), max_tokens=MAX_TOKENS, temperature=0.0, logprobs=20, progress=False)
        yield engine, results, engine.stats()["num_preemptions"]


@pytest.fixture(scope="module")
def hf(real_model_dir, served, real_hf_logprobs):
    """transformers' tokenizer and its log-softmax at every position of each served sequence
    (the GGUF file loaded as float32; conftest's ``real_hf_logprobs``)."""
    from transformers import AutoTokenizer

    _, results, _ = served
    logprobs = real_hf_logprobs([r.prompt_token_ids + r.token_ids for r in results])
    return AutoTokenizer.from_pretrained(str(real_model_dir)), logprobs


def chats() -> list[list[dict]]:
    return [[{"role": "user", "content": question}] for question in QUESTIONS]


def test_the_chat_template_renders_as_transformers(served, hf) -> None:
    engine, _, _ = served
    tokenizer, _ = hf
    for messages in chats()[:4] + [[{"role": "system", "content": "Be brief."}, *chats()[0]]]:
        ours = engine.tokenizer.render_chat(messages)
        assert ours == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert (
            engine.tokenizer.encode(ours, add_special_tokens=False)
            == tokenizer(ours, add_special_tokens=False)["input_ids"]
        )


def test_greedy_chat_equals_transformers_through_chunking_and_preemption(served, hf) -> None:
    _, results, preemptions = served
    _, logprobs = hf
    assert preemptions > 0, "the small pool never preempted"
    assert min(len(r.prompt_token_ids) for r in results) > 32, "a prompt fit one iteration: no chunked prefill"
    assert "Paris" in results[0].text, results[0].text
    for i, result in enumerate(results):
        start = len(result.prompt_token_ids)
        assert result.token_ids, result
        expected = logprobs[i, start - 1 : start - 1 + len(result.token_ids)].argmax(dim=-1).tolist()
        assert result.token_ids == expected, (QUESTIONS[i], result.text)
        if result.finish_reason == "length":
            assert len(result.token_ids) == MAX_TOKENS
        else:  # stopped at its end of turn, as transformers' greedy would
            assert result.token_ids[-1] in served[0].model_config.eos_token_ids


def test_top20_logprobs_equal_transformers_log_softmax(served, hf) -> None:
    _, results, _ = served
    _, logprobs = hf
    for i, result in enumerate(results):
        start = len(result.prompt_token_ids)
        [output] = result.outputs
        assert len(output.logprobs) == len(result.token_ids)
        for step, entry in enumerate(output.logprobs):
            row = logprobs[i, start - 1 + step]
            top = torch.topk(row, 20)
            assert len(entry.top) == 20
            # the same 20 tokens, most likely first up to values within 1e-4 (ties)
            assert {t.token_id for t in entry.top} == set(top.indices.tolist()), (i, step)
            for t in entry.top:
                assert abs(t.logprob - float(row[t.token_id])) <= 1e-4, (i, step, t)
            assert abs(entry.logprob - float(row[entry.token_id])) <= 1e-4
