"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers through every
path a request can take besides those of tests/e2e/test_real_model.py (chunked prefill,
recompute preemption): swap preemption, prefix reuse, continuation (by id, and
``continue_final_message``), n > 1 (greedy and seeded), n-gram speculative decoding and tensor
parallelism (gloo) over 3 ranks: SmolLM2's 9 query heads do not split over 2 (2 ranks are
tested on tiny checkpoints, tests/worker/test_tensor_parallel.py).

Two engines: one rank with a KV pool too small for its batch (swap space beside it) and
n-gram speculation on (requests opt out with ``speculate=False``, so plain and speculative
greedy run on one engine), and three ranks. Every greedy output is checked teacher-forced
against transformers on the same file (conftest's ``hf_greedy_check``), the weights served
dequantized to float32 (``quantization="none"``) as transformers loads them.
"""

from __future__ import annotations

import pytest

GREEDY = dict(temperature=0.0)
SYSTEM = "You are a concise assistant for a geography quiz. Answer with the name only, no explanation."
QUESTIONS = [
    "What is the capital of France?",
    "Repeat exactly: red blue red blue red blue red blue",
    "Count from one to ten in words.",
    "What is 12 plus 30?",
    "Name three primary colors.",
    "What comes after Tuesday?",
]


def chat(question: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def run_all(engine) -> None:
    while engine.has_pending_requests():
        engine.step()


@pytest.fixture(scope="module")
def engine(real_model_dir):
    from conveyor import Engine

    with Engine(
        str(real_model_dir), device="cpu", quantization="none", threads=1, block_size=8, num_kv_blocks=24,
        num_cpu_blocks=64,
        preemption="swap", speculative_method="ngram", num_speculative_tokens=3, ngram_max=3, ngram_min=1,
    ) as engine:  # fmt: skip
        yield engine


@pytest.fixture(scope="module")
def plain(engine):
    """The six questions at once, greedy, without speculation, under swap preemption."""
    before = engine.stats()["num_preemptions_swap"]
    results = engine.generate([chat(q) for q in QUESTIONS], max_tokens=16, speculate=False, progress=False, **GREEDY)
    return results, engine.stats()["num_preemptions_swap"] - before


def test_swap_preemption_equals_transformers(plain, hf_greedy_check) -> None:
    results, swaps = plain
    assert swaps > 0, "the small pool never swapped a sequence out"
    assert "Paris" in results[0].text, results[0].text
    assert hf_greedy_check([(r.prompt_token_ids, r.token_ids) for r in results]) == []


def test_ngram_speculation_equals_plain_greedy(engine, plain, hf_greedy_check) -> None:
    before = engine.stats()["spec_accepted_tokens"]
    results = engine.generate([chat(q) for q in QUESTIONS], max_tokens=16, progress=False, **GREEDY)
    assert engine.stats()["spec_accepted_tokens"] > before, "no proposal was ever accepted: nothing speculated"
    assert [r.token_ids for r in results] == [r.token_ids for r in plain[0]]
    assert hf_greedy_check([(r.prompt_token_ids, r.token_ids) for r in results]) == []


def test_prefix_reuse_of_a_shared_system_prompt(engine, hf_greedy_check) -> None:
    first = engine.add_request(
        messages=chat("What is the capital of Italy?", SYSTEM), max_tokens=8, speculate=False, **GREEDY
    )
    run_all(engine)
    second = engine.add_request(
        messages=chat("What is the capital of Spain?", SYSTEM), max_tokens=8, speculate=False, **GREEDY
    )
    run_all(engine)
    shared = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, second.prompt_token_ids)) if a != b)
    assert shared > 20 and second.num_cached_tokens >= shared - shared % 8 - 8, (shared, second.num_cached_tokens)
    assert hf_greedy_check([(r.prompt_token_ids, r.tokens) for r in (first, second)]) == []
    for request in (first, second):
        request.remove()


def test_continuation_by_id_and_of_the_final_message(engine, hf_greedy_check) -> None:
    first = engine.add_request(
        messages=chat("What is the capital of France?"), request_id="conv", max_tokens=12, **GREEDY
    )
    run_all(engine)
    context = first.prompt_token_ids + first.tokens
    second = engine.add_request(messages=chat("And of Germany?"), request_id="conv", max_tokens=12, **GREEDY)
    run_all(engine)
    assert second.prompt_token_ids[: len(context)] == context
    assert second.num_cached_tokens >= len(context) - 8
    partial = [*chat("Name a large animal."), {"role": "assistant", "content": "A large animal is the"}]
    third = engine.add_request(messages=partial, continue_final_message=True, max_tokens=6, **GREEDY)
    run_all(engine)
    assert engine.tokenizer.decode(third.prompt_token_ids).endswith("A large animal is the")
    assert hf_greedy_check([(r.prompt_token_ids, r.tokens) for r in (first, second, third)]) == []
    for request in (first, second, third):
        request.remove()


def test_n2_greedy_both_equal_transformers_and_seeded_sampling_reproduces(engine, hf_greedy_check) -> None:
    [greedy] = engine.generate([chat(QUESTIONS[2])], n=2, max_tokens=10, progress=False, **GREEDY)
    a, b = greedy.outputs
    assert a.token_ids == b.token_ids
    assert hf_greedy_check([(greedy.prompt_token_ids, a.token_ids)]) == []
    sampled = dict(temperature=0.9, top_p=0.95, max_tokens=10, progress=False)
    [twice, again] = [engine.generate([chat(QUESTIONS[4])], n=2, seed=7, **sampled)[0] for _ in range(2)]
    [alone] = engine.generate([chat(QUESTIONS[4])], seed=8, **sampled)
    assert [o.token_ids for o in twice.outputs] == [o.token_ids for o in again.outputs]
    assert twice.outputs[1].token_ids == alone.token_ids  # sequence i draws with seed + i


def test_tensor_parallel_3_equals_transformers(real_model_dir, plain, hf_greedy_check) -> None:
    from conveyor import Engine

    with Engine(
        str(real_model_dir),
        device="cpu",
        quantization="none",
        threads=1,
        tensor_parallel_size=3,
        distributed_timeout_s=120,
    ) as engine:
        results = engine.generate([chat(q) for q in QUESTIONS[:2]], max_tokens=8, progress=False, **GREEDY)
    assert hf_greedy_check([(r.prompt_token_ids, r.token_ids) for r in results]) == []
    assert [r.token_ids for r in results] == [r.token_ids[:8] for r in plain[0][:2]]
