"""A mixture of experts' experts kept quantized on the CPU: ``--quantization gguf`` on a Q8_0 /
Q4_0 / Q4_1 Qwen3-MoE GGUF file serves each expert as one quantized method of the file's own
blocks (Int8Weights / Int4Weights), the router float, and each sparse layer's output stays
within the methods' rounding (activations per token; Q8_0 requantized per channel, as every
int8 layer is on the CPU) of a float32 reference whose experts are dequantized
by the format's definition (tests/worker/test_quantization.py's ``gguf_by_definition``, written
from ggml's block layouts, not from the decoder under test); ``--quantization int8`` on the
float checkpoint likewise, against its experts quantized per channel by definition."""

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
from tests.worker.test_quantization import gguf_by_definition, int8_by_definition

METHODS = {Q.Q8_0: Int8Weights, Q.Q4_0: Int4Weights, Q.Q4_1: Int4Weights}


@pytest.fixture(scope="module")
def hf_qwen3_moe(tmp_path_factory):
    """``(checkpoint directory, the HF model)``: 3 layers, the middle one dense, 8 experts of width 32."""
    from tests.checkpoints import make_checkpoint

    directory = tmp_path_factory.mktemp("hf")
    return directory, make_checkpoint("qwen3_moe", directory)


def _served(path, directory, quantization: str):
    """The model of GGUF file ``path`` through a prepared directory (less the tokenizer)."""
    config, _ = hf_config(open_gguf(path), path)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / POINTER).write_text(json.dumps({"path": str(path)}))
    model, _ = load_model(directory, device="cpu", quantization=quantization)
    return model


def _reference(x, expert, top_weights, top_experts):
    """float32 ``sum_j w_j down_e(silu(gate_e x) * up_e x)`` token by token; ``expert(name, e)``:
    expert ``e``'s ``gate`` / ``up`` / ``down`` matrix as the reference holds it."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(top_weights[t].tolist(), top_experts[t].tolist()):
            gate, up, down = (expert(name, e) for name in ("gate", "up", "down"))
            out[t] += w * (down @ (F.silu(gate @ x[t]) * (up @ x[t])))
    return out


def _check_sparse_layers(model, experts_of_layer, method) -> None:
    """Each sparse layer's experts are ``method`` objects, its router float, and its output on
    random tokens within 3 % (of the output's scale) of :func:`_reference` on
    ``experts_of_layer(layer)``, far from it with every token's experts shifted by one."""
    generator = torch.Generator().manual_seed(7)
    for layer in (0, 2):  # the sparse ones (layer 1 is dense)
        mlp = model.layers[layer].mlp
        assert mlp.w13 is None and mlp.w2 is None, "the float stacks were kept beside the quantized experts"
        methods = mlp.quantized["w13"].quant + mlp.quantized["w2"].quant
        assert len(methods) == 16 and all(type(m) is method for m in methods)
        assert mlp.gate.quant is None and mlp.gate.weight.dtype == torch.float32  # the router stays float
        x = torch.randn(9, 64, generator=generator)
        with torch.no_grad():
            top_weights, top_experts = route(mlp.gate(x), mlp.top_k, mlp.renormalize)
            ours = mlp(x)
        expert = experts_of_layer(layer)
        want = _reference(x, expert, top_weights, top_experts)
        # the methods round activations (int8 per token; int4's bfloat16): ~1 % of the output's scale
        scale = float(want.abs().max())
        error = float((ours - want).abs().max())
        assert error <= 0.03 * scale, (layer, error, scale)
        wrong = _reference(x, expert, top_weights, (top_experts + 1) % 8)
        assert float((wrong - want).abs().max()) > 10 * error  # an expert read into another's place shows


@pytest.mark.parametrize("qtype", list(METHODS), ids=lambda q: q.name)
def test_gguf_experts_compute_as_their_blocks_define(qtype, hf_qwen3_moe, tmp_path) -> None:
    path = write_gguf(tmp_path / f"m.{qtype.name}.gguf", hf_qwen3_moe[1], qtype, arch="qwen3moe")
    model = _served(path, tmp_path / "prepared", "gguf")
    tensors = {t.name: t for t in open_gguf(path).tensors}

    def experts_of_layer(layer: int):
        def expert(name: str, e: int) -> torch.Tensor:  # the file's stacked blocks, expert e's
            tensor = tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
            cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
            return gguf_by_definition(np.asarray(tensor.data[e]), qtype, (rows, cols))

        return expert

    _check_sparse_layers(model, experts_of_layer, METHODS[qtype])


def test_int8_on_the_float_checkpoint_quantizes_each_expert_per_channel(hf_qwen3_moe) -> None:
    directory, hf = hf_qwen3_moe
    model, _ = load_model(directory, device="cpu", quantization="int8")

    def experts_of_layer(layer: int):
        stacks = hf.model.layers[layer].mlp.experts
        width = stacks.down_proj.shape[-1]

        def expert(name: str, e: int) -> torch.Tensor:
            matrix = {
                "gate": stacks.gate_up_proj[e, :width],
                "up": stacks.gate_up_proj[e, width:],
                "down": stacks.down_proj[e],
            }[name]
            return int8_by_definition(matrix.detach().float())

        return expert

    _check_sparse_layers(model, experts_of_layer, Int8Weights)


def test_quantization_none_dequantizes_the_experts(hf_qwen3_moe, tmp_path) -> None:
    path = write_gguf(tmp_path / "m.Q8_0.gguf", hf_qwen3_moe[1], Q.Q8_0, arch="qwen3moe")
    mlp = _served(path, tmp_path / "prepared", "none").layers[0].mlp
    assert not mlp.quantized and mlp.w13.dtype == torch.float32
