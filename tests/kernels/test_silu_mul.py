"""SiLU-and-multiply: the Triton kernel and the device dispatch against the float32 reference."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.layer_ops import silu_and_mul
from conveyor.kernels.silu_mul import silu_mul_ref, silu_mul_triton
from conveyor_tools.kernels.testing import ROUNDED_TOLERANCES, ROW_CASES, assert_close


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(("tokens", "width", "dtype"), ROW_CASES)
def test_silu_mul_kernel_matches_reference(device, gen, tokens, width, dtype, strided) -> None:
    wide = torch.randn(tokens, 2 * width + (16 if strided else 0), generator=gen).mul(3).to(device=device, dtype=dtype)
    gate_up = wide[:, : 2 * width]
    want = silu_mul_ref(gate_up)
    out = silu_mul_triton(gate_up)
    assert out.shape == (tokens, width) and out.dtype == dtype
    assert_close(out, want, ROUNDED_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_dispatch_matches_reference(device, gen, dtype) -> None:
    gate_up = torch.randn(4, 2 * 48, generator=gen).mul(3).to(device=device, dtype=dtype)
    want = silu_mul_ref(gate_up)
    assert_close(silu_and_mul(gate_up), want, ROUNDED_TOLERANCES[dtype])
