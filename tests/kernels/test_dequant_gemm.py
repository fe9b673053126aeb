"""The Triton dequantize-GEMM against a float32 reference that dequantizes by the definition
(``scale * code + offset`` per group), on fresh random codes, decode and prefill row counts."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.dequant_gemm import dequant_gemm, pack_int4


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize(
    ("bits", "group", "offsets", "bias"),
    [(4, 32, True, False), (4, 16, False, True), (8, 64, False, True), (8, 32, True, False)],
)
def test_dequant_gemm_matches_float32_reference(device, gen, rows, bits, group, offsets, bias) -> None:
    n, k = 40, 64
    top = 16 if bits == 4 else 256
    codes = torch.randint(0, top, (n, k), generator=gen) - (0 if bits == 4 else 128)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    offs = torch.randn(n, k // group, generator=gen) * 0.1 if offsets else None
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    weight = codes.float() * scales.repeat_interleave(group, 1) + (
        0 if offs is None else offs.repeat_interleave(group, 1)
    )
    want = x @ weight.t() + (0 if b is None else b)
    stored = pack_int4(codes) if bits == 4 else codes.to(torch.int8)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = dequant_gemm(to(x), to(stored), to(scales), to(offs), bits, group, to(b))
    assert got.shape == (rows, n)
    torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=1e-3)


def test_packed_nibbles_put_the_even_column_low(gen) -> None:
    codes = torch.randint(0, 16, (3, 8), generator=gen)
    packed = pack_int4(codes)
    assert torch.equal(packed & 0xF, codes[:, 0::2].to(torch.uint8)) and torch.equal(
        packed >> 4, codes[:, 1::2].to(torch.uint8)
    )
