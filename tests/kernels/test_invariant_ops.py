"""The batch-invariant matmul and row softmax (and the RMSNorm kernel the mode keeps): each
against its float32 torch reference on random inputs, and a row's bits the same whatever
other rows share its launch (row 0 at M = 1 against M = 2, 3, 17, 70; a row at every offset)."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.invariant_matmul import BLOCK_M, invariant_linear, linear_ref
from conveyor.kernels.invariant_softmax import row_softmax, row_softmax_ref
from conveyor.kernels.rms_norm import add_rms_norm_triton
from conveyor_tools.kernels.testing import ROUNDED_TOLERANCES, assert_close

ROW_COUNTS = (1, 2, 3, 17, BLOCK_M + 6)
MATMUL_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def _randn(gen, device, dtype, *shape):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize(("dtype", "k", "n", "bias"), [(torch.float32, 200, 96, True), (torch.bfloat16, 64, 72, False)])
def test_invariant_linear_matches_reference_and_is_row_invariant(device, gen, dtype, k, n, bias) -> None:
    rows = max(ROW_COUNTS)
    x = _randn(gen, device, dtype, rows, k)
    weight = _randn(gen, device, dtype, n, k) * k**-0.5
    b = _randn(gen, device, dtype, n) if bias else None
    together = invariant_linear(x, weight, b)
    assert together.dtype == dtype and together.shape == (rows, n)
    assert_close(together, linear_ref(x, weight, b), MATMUL_TOLERANCES[dtype])
    alone = invariant_linear(x[:1], weight, b)
    for count in ROW_COUNTS:  # row 0 among 1, 2, 3, 17 and 70 rows (two row tiles)
        assert torch.equal(invariant_linear(x[:count], weight, b)[0], alone[0]), count
    for start in (1, 5, BLOCK_M - 1, BLOCK_M + 2):  # a row at another offset of its tile, and in the next tile
        assert torch.equal(invariant_linear(x[start : start + 3], weight, b), together[start : start + 3]), start


def test_invariant_linear_keeps_leading_dims_and_rejects_bad_shapes(device, gen) -> None:
    x = _randn(gen, device, torch.float32, 2, 3, 16)
    weight = _randn(gen, device, torch.float32, 8, 16)
    assert torch.equal(invariant_linear(x, weight), invariant_linear(x.reshape(6, 16), weight).view(2, 3, 8))
    assert invariant_linear(x[:0, 0], weight).shape == (0, 8)
    with pytest.raises(ValueError, match="weight"):
        invariant_linear(x, weight[:, :8])
    with pytest.raises(TypeError, match="dtype"):
        invariant_linear(x, weight.double())


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize(("vocab", "dtype"), [(2500, torch.float32), (700, torch.bfloat16)])
def test_row_softmax_matches_reference_and_is_row_invariant(device, gen, log, vocab, dtype) -> None:
    logits = (_randn(gen, device, torch.float32, 17, vocab) * 4).to(dtype)
    logits[3, ::7] = float("-inf")  # a grammar-masked row
    together = row_softmax(logits, log)
    want = row_softmax_ref(logits, log)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(together))
    assert_close(together[finite], want[finite], (1e-5, 1e-5) if log else (1e-5, 1e-7))
    for count in ROW_COUNTS[:-1]:
        assert torch.equal(row_softmax(logits[:count], log), together[:count]), count
    assert torch.equal(row_softmax(logits[3:5], log), together[3:5])


def test_rms_norm_kernel_is_row_invariant(device, gen) -> None:
    """The mode keeps the model's own RMSNorm kernel on CUDA: one program per row, its
    reduction fixed by the hidden size (:mod:`conveyor.kernels.rms_norm`)."""
    x = _randn(gen, device, torch.bfloat16, 17, 576)
    residual = _randn(gen, device, torch.bfloat16, 17, 576)
    weight = 1.0 + 0.2 * _randn(gen, device, torch.bfloat16, 576)
    together, _ = add_rms_norm_triton(x, residual.clone(), weight, 1e-5)
    for count in ROW_COUNTS[:-1]:
        alone, _ = add_rms_norm_triton(x[:count], residual[:count].clone(), weight, 1e-5)
        assert torch.equal(alone, together[:count]), count
    assert_close(
        add_rms_norm_triton(x[:1], None, weight, 1e-5)[0],
        (x[:1].float() * torch.rsqrt(x[:1].float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype).float()
        * weight.float(),
        ROUNDED_TOLERANCES[torch.bfloat16],
    )
