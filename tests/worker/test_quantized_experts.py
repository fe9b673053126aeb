"""A mixture of experts' experts kept quantized on the CPU: ``--quantization gguf`` on a Q8_0 /
Q4_0 / Q4_1 Qwen3-MoE GGUF file serves each expert as one quantized method of the file's own
blocks (Int8Weights / Int4Weights), the router float, and each sparse layer's output stays
within the methods' rounding (activations per token; Q8_0 requantized per channel, as every
int8 layer is on the CPU) of a float32 reference whose experts are dequantized
by the format's definition (tests/worker/test_quantization.py's ``gguf_by_definition``, written
from ggml's block layouts, not from the decoder under test)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from conveyor.checkpoints.gguf.prepare import POINTER
from conveyor.checkpoints.gguf.reader import hf_config, open_gguf
from conveyor.worker.loader import load_model
from conveyor.worker.models.moe import route
from conveyor.worker.quantization.methods import Int4Weights, Int8Weights
from tests.gguf_files import write_gguf
from tests.worker.test_quantization import gguf_by_definition

METHODS = {Q.Q8_0: Int8Weights, Q.Q4_0: Int4Weights, Q.Q4_1: Int4Weights}


@pytest.fixture(scope="module")
def hf_qwen3_moe(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("hf"))


def _served(path, directory, quantization: str):
    """The model of GGUF file ``path`` through a prepared directory (less the tokenizer)."""
    config, _ = hf_config(open_gguf(path), path)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / POINTER).write_text(json.dumps({"path": str(path)}))
    model, _ = load_model(directory, device="cpu", quantization=quantization)
    return model


def _reference(x, layer, reader, qtype, top_weights, top_experts):
    """float32 ``sum_j w_j down_e(silu(gate_e x) * up_e x)`` token by token, every expert's
    matrices dequantized by definition from the file's stacked blocks."""
    tensors = {t.name: t for t in reader.tensors}

    def expert(suffix: str, e: int) -> torch.Tensor:
        tensor = tensors[f"blk.{layer}.{suffix}"]
        cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
        return gguf_by_definition(np.asarray(tensor.data[e]), qtype, (rows, cols))

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(top_weights[t].tolist(), top_experts[t].tolist()):
            gate, up, down = (expert(f"ffn_{name}_exps.weight", e) for name in ("gate", "up", "down"))
            out[t] += w * (down @ (F.silu(gate @ x[t]) * (up @ x[t])))
    return out


@pytest.mark.parametrize("qtype", list(METHODS), ids=lambda q: q.name)
def test_quantized_experts_compute_as_their_blocks_define(qtype, hf_qwen3_moe, tmp_path) -> None:
    path = write_gguf(tmp_path / f"m.{qtype.name}.gguf", hf_qwen3_moe, qtype, arch="qwen3moe")
    model = _served(path, tmp_path / "prepared", "gguf")
    reader = open_gguf(path)
    generator = torch.Generator().manual_seed(7)
    for layer in (0, 2):  # the sparse ones (layer 1 is dense)
        mlp = model.layers[layer].mlp
        assert mlp.w13 is None and mlp.w2 is None, "the float stacks were kept beside the quantized experts"
        methods = mlp.quantized["w13"].quant + mlp.quantized["w2"].quant
        assert len(methods) == 16 and all(type(m) is METHODS[qtype] for m in methods)
        assert mlp.gate.quant is None and mlp.gate.weight.dtype == torch.float32  # the router stays float
        x = torch.randn(9, 64, generator=generator)
        with torch.no_grad():
            top_weights, top_experts = route(mlp.gate(x), mlp.top_k, mlp.renormalize)
            ours = mlp(x)
        want = _reference(x, layer, reader, qtype, top_weights, top_experts)
        # the methods round activations (int8 per token; int4's bfloat16): ~1 % of the output's scale
        scale = float(want.abs().max())
        error = float((ours - want).abs().max())
        assert error <= 0.03 * scale, (layer, error, scale)
        wrong = _reference(x, layer, reader, qtype, top_weights, (top_experts + 1) % 8)
        assert float((wrong - want).abs().max()) > 10 * error  # an expert read into another's place shows


def test_quantization_none_dequantizes_the_experts(hf_qwen3_moe, tmp_path) -> None:
    path = write_gguf(tmp_path / "m.Q8_0.gguf", hf_qwen3_moe, Q.Q8_0, arch="qwen3moe")
    mlp = _served(path, tmp_path / "prepared", "none").layers[0].mlp
    assert not mlp.quantized and mlp.w13.dtype == torch.float32
