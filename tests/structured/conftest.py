"""Shared pieces of the structured-output tests: the demo tokenizer as the engine sees it, and
a "model" whose logits are seeded random numbers, so only the constraint can make its output
valid. Sampling goes through the worker's mask applier, in batches with unconstrained rows."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tokenizers import Tokenizer

from conveyor.checkpoints.demo.checkpoint import END_OF_TURN, TOKENIZER_DIR
from conveyor.structured import CompiledGrammar, EngineTokenizer, GrammarCompiler, allocate_bitmask, fill_rows
from conveyor.worker.grammar_mask import apply_token_bitmask

pytest.importorskip("llguidance", reason="structured output needs the [structured] extra (in [test])")

BACKEND = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
EOS = BACKEND.token_to_id(END_OF_TURN)
VOCAB = BACKEND.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="session")
def engine_tokenizer() -> EngineTokenizer:
    return EngineTokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"), [EOS], VOCAB)


@pytest.fixture
def compiler(engine_tokenizer: EngineTokenizer):
    c = GrammarCompiler(engine_tokenizer, max_entries=64, timeout_s=30)
    yield c
    c.close()


def generate_batch(
    grammars: Sequence[CompiledGrammar], seed: int, *, free_rows: int = 1, max_tokens: int = 400, must_end: bool = True
) -> list[str | None]:
    """Decode each grammar once, all in one batch, from seeded random logits (scaled so the
    distribution is far from uniform) until end-of-sequence. ``free_rows`` unconstrained rows
    ride along; the test fails if a constrained row hits a dead end, or runs out of tokens while
    ``must_end`` (else its text is None), or if an unconstrained row's logits are touched."""
    gen = torch.Generator().manual_seed(seed)
    matchers = [g.matcher() for g in grammars]
    rows = list(range(free_rows, free_rows + len(matchers)))  # constrained rows after the free ones
    batch = free_rows + len(matchers)
    bitmask = allocate_bitmask(batch, VOCAB)
    tokens: list[list[int]] = [[] for _ in matchers]
    live = dict(zip(rows, range(len(matchers))))
    for _ in range(max_tokens):
        if not live:
            break
        dead = fill_rows([(matchers[i], r) for r, i in live.items()], bitmask)
        assert not dead, [matchers[live[r]].error for r in dead]
        logits = torch.randn(batch, VOCAB, generator=gen) * 4
        before = logits[:free_rows].clone()
        apply_token_bitmask(logits, torch.from_numpy(bitmask), list(live))
        assert torch.equal(logits[:free_rows], before)
        picks = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1).tolist()
        for r, i in list(live.items()):
            if picks[r] == EOS:
                assert matchers[i].is_accepting
                del live[r]
                continue
            assert matchers[i].accept(picks[r]), matchers[i].error
            tokens[i].append(picks[r])
    assert not (must_end and live), f"{len(live)} rows still running after {max_tokens} tokens"
    unfinished = set(live.values())
    return [None if i in unfinished else BACKEND.decode(t, skip_special_tokens=False) for i, t in enumerate(tokens)]
