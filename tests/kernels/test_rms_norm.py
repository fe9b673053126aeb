"""Residual add + RMSNorm: the Triton kernel and the device dispatch against the float32
reference, with and without a residual, on strided rows as the model passes them."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.layer_ops import add_rms_norm
from conveyor.kernels.rms_norm import add_rms_norm_ref, add_rms_norm_triton
from conveyor_tools.kernels.testing import ROUNDED_TOLERANCES, ROW_CASES, assert_close

EPS = 1e-6


def _inputs(gen, device, tokens, hidden, dtype, strided):
    def rows() -> torch.Tensor:
        if not strided:
            return torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
        wide = torch.randn(tokens, hidden + 24, generator=gen).to(device=device, dtype=dtype)
        return wide[:, 8 : 8 + hidden]  # rows of a wider buffer, hidden dim contiguous

    x, residual = rows(), rows()
    weight = (1.0 + 0.2 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
    return x, residual, weight


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("tokens", "hidden", "dtype"), ROW_CASES)
def test_add_rms_norm_kernel_matches_reference(device, gen, tokens, hidden, dtype, with_residual, strided) -> None:
    x, residual, weight = _inputs(gen, device, tokens, hidden, dtype, strided)
    residual = residual if with_residual else None
    want_normed, want_sum = add_rms_norm_ref(x, residual, weight, EPS)
    x_before = x.clone()
    normed, summed = add_rms_norm_triton(x, residual, weight, EPS)
    assert normed.dtype == dtype and normed.shape == x.shape
    assert_close(normed, want_normed, ROUNDED_TOLERANCES[dtype])
    assert_close(summed, want_sum, ROUNDED_TOLERANCES[dtype])
    assert torch.equal(x, x_before)
    assert summed is (residual if with_residual else x)  # the residual stream is updated in place


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_rms_norm_dispatch_matches_reference(device, gen, dtype, with_residual) -> None:
    """The function the model calls, on this machine's device (torch on CPU, Triton on CUDA)."""
    x, residual, weight = _inputs(gen, device, 6, 160, dtype, strided=False)
    residual = residual if with_residual else None
    want_normed, want_sum = add_rms_norm_ref(x, residual, weight, EPS)
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    assert_close(normed, want_normed, ROUNDED_TOLERANCES[dtype])
    assert_close(summed, want_sum, ROUNDED_TOLERANCES[dtype])


def test_rms_norm_dispatch_per_head(device, gen) -> None:
    """Qwen3's q/k norm shape: [T, heads, head_dim] strided heads of a fused projection."""
    fused = torch.randn(3, 7, 32, generator=gen).to(device)
    heads = fused[:, 1:5]
    weight = (1.0 + 0.2 * torch.randn(32, generator=gen)).to(device)
    normed, same = add_rms_norm(heads, None, weight, EPS)
    assert same is heads
    assert_close(
        normed,
        add_rms_norm_ref(heads.reshape(-1, 32), None, weight, EPS)[0].view(3, 4, 32),
        ROUNDED_TOLERANCES[torch.float32],
    )


def test_add_rms_norm_rejects_bad_shapes(device) -> None:
    x = torch.zeros(2, 16, device=device)
    with pytest.raises(ValueError):
        add_rms_norm_triton(x, None, torch.ones(8, device=device), EPS)
    with pytest.raises(ValueError):
        add_rms_norm_triton(x, torch.zeros(2, 8, device=device), torch.ones(16, device=device), EPS)
