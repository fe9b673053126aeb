"""The CPU projections through oneDNN on packed weights (worker.models.layers.linear): every
Linear of a model loaded for the CPU in float32 is packed, and the packed path computes what
F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.worker.loader import load_model
from conveyor.worker.models.layers import Linear, linear, pack_cpu_weight

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matmul_equals_f_linear(rows, bias) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    packed = pack_cpu_weight(weight)
    assert packed is not None
    torch.testing.assert_close(linear(x, weight, b, packed), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_only_float32_on_the_cpu_is_packed() -> None:
    assert pack_cpu_weight(torch.zeros(4, 4, dtype=torch.bfloat16)) is None
    assert pack_cpu_weight(torch.zeros(4, 4)) is not None


def test_a_cpu_model_is_packed_and_its_logits_unchanged(checkpoint) -> None:
    _, path, _ = checkpoint  # each family of tests/worker/conftest.py, tied and untied heads
    model, config = load_model(path, "cpu", "float32")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert (model.tied_head_packed is not None) == config.tie_word_embeddings
    hidden = torch.randn(5, config.hidden_size)
    packed_logits = model.compute_logits(hidden)
    for m in linears:
        m.packed = None
    model.tied_head_packed = None
    torch.testing.assert_close(packed_logits, model.compute_logits(hidden), rtol=1e-5, atol=1e-5)
