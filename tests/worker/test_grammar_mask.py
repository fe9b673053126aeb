"""The bitmask applier against a float32 reference that reads the bits one by one."""

from __future__ import annotations

import pytest
import torch

from conveyor.worker.grammar_mask import apply_token_bitmask, backend_for


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize(
    ("batch", "vocab", "words", "rows"), [(4, 100, 4, [1, 3]), (3, 70, 2, [0, 1, 2]), (5, 64, 2, [])]
)
def test_masks_only_the_constrained_rows(batch, vocab, words, rows) -> None:
    """vocab 70 over 2 words: tokens 64..69 lie past the mask and are never allowed."""
    gen = torch.Generator().manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)
    expected = _reference(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_cpu_uses_the_torch_path() -> None:
    assert backend_for(torch.device("cpu")) == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_matches_the_reference(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 1000, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, 30), dtype=torch.int32, generator=gen)  # 960 < 1000 tokens
    rows = [0, 2, 5, 7]
    expected = _reference(logits.float(), bitmask, rows).to(dtype)
    on_device = logits.cuda()
    apply_token_bitmask(on_device, bitmask, rows)
    assert torch.equal(on_device.cpu(), expected)


def test_torch_path_runs_on_the_calling_thread(monkeypatch) -> None:
    """The mask's ops run with torch's intra-op parallelism off (on a loaded CPU each parallel
    region waits for an idle OpenMP worker to be scheduled: docs/structured-output.md), and
    the caller's thread count comes back, also when the pass raises."""
    import conveyor.worker.grammar_mask as grammar_mask

    seen: list[int] = []
    real = grammar_mask._apply_torch

    def spy(logits, bitmask, rows):
        seen.append(torch.get_num_threads())
        real(logits, bitmask, rows)

    monkeypatch.setattr(grammar_mask, "_apply_torch", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = torch.zeros(2, 64)
        apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), [1])
        assert seen == [1] and torch.get_num_threads() == 2
        assert torch.isinf(logits[1]).all() and not torch.isinf(logits[0]).any()
        with pytest.raises(IndexError):
            apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [5])  # no row 5
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
