"""Our model's logits equal transformers' on the same checkpoint, for a ragged batch that
mixes a continued prefill (cached prefix in the paged pool) with a fresh prompt."""

from __future__ import annotations

import torch

from conveyor.worker.attention.backend import AttentionMetadata, token_positions
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.loader import load_model

BLOCK_SIZE = 4


def forward_logits(model, block_size, query_lens, context_lens, tables, tokens) -> torch.Tensor:
    metadata = AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cpu")
    positions = torch.from_numpy(token_positions(query_lens, context_lens))
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), positions, metadata)
        return model.compute_logits(hidden)


def test_prefill_logits_match_transformers(checkpoint):
    name, directory, hf_model = checkpoint
    model, config = load_model(directory, "cpu", "auto")
    assert model.dtype == torch.float32
    model.bind_kv_cache(KVCacheShape.of(config, BLOCK_SIZE, torch.float32).allocate(16, "cpu"))
    generator = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(0, config.vocab_size, (14,), generator=generator).tolist()
    short_prompt = torch.randint(0, config.vocab_size, (5,), generator=generator).tolist()
    long_table, short_table = [7, 2, 11, 0], [5, 9]

    # Step 1: the first 6 tokens of the long prompt. Step 2: its other 8 beside the short prompt.
    first = forward_logits(model, BLOCK_SIZE, [6], [0], [long_table], long_prompt[:6])
    second = forward_logits(
        model, BLOCK_SIZE, [8, 5], [6, 0], [long_table, short_table], long_prompt[6:] + short_prompt
    )
    with torch.no_grad():
        expected_long = hf_model(torch.tensor([long_prompt])).logits[0].float()
        expected_short = hf_model(torch.tensor([short_prompt])).logits[0].float()
    torch.testing.assert_close(first, expected_long[:6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[:8], expected_long[6:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[8:], expected_short, atol=1e-4, rtol=1e-4)
