"""GPTQ and AWQ checkpoints: tiny ones written here from random weights, packed by each
format's definition (written in this file from the formats, not from the loader), served
kept quantized (``--quantization auto``) with greedy tokens equal to transformers running
the float32 weights the test dequantized, and served float (``--quantization none``)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.quantization.methods import Int4Weights
from tests.worker.test_quantization import LINEARS, assert_matches, prompts_for, served_head

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit of ``w`` ``[out, in]`` in groups of GROUP inputs: codes ``[in, out]``,
    integer zeros and scales ``[G, out]`` with ``w ~ scale * (code - zero)``."""
    g = w.t().reshape(-1, GROUP, w.shape[0])  # [G, GROUP, out]
    low, high = g.amin(1), g.amax(1)
    scales = ((high - low) / 15).clamp_min(1e-6).half().float()
    zeros = torch.round(-low / scales).clamp(0, 15)
    codes = torch.round(g / scales[:, None] + zeros[:, None]).clamp(0, 15)
    return codes.reshape(w.shape[1], w.shape[0]).int(), zeros.int(), scales


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit values per int32 along dim 0, the first in the lowest nibble."""
    v = values.reshape(-1, 8, *values.shape[1:]).to(torch.int64)
    word = sum(v[:, i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_cols(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """Eight 4-bit values per int32 along dim 1: nibble i holds column ``order[i]`` of each eight."""
    v = values.reshape(values.shape[0], -1, 8).to(torch.int64)
    word = sum(v[..., order[i]] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def write_packed(hf: torch.nn.Module, directory, method: str) -> torch.nn.Module:
    """Save ``hf`` as a ``method`` checkpoint; return transformers on the dequantized weights."""
    reference = copy.deepcopy(hf)
    tensors = {}
    for name, param in hf.state_dict().items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and module[-2] in LINEARS:
            prefix = name.removesuffix(".weight")
            codes, zeros, scales = quantize_groups(param.float())
            if method == "gptq":
                tensors[f"{prefix}.qweight"] = pack_rows(codes)
                tensors[f"{prefix}.qzeros"] = pack_cols(zeros - 1)  # GPTQ stores zero - 1
                tensors[f"{prefix}.g_idx"] = torch.arange(param.shape[1], dtype=torch.int32) // GROUP
            else:
                tensors[f"{prefix}.qweight"] = pack_cols(codes, AWQ_ORDER)
                tensors[f"{prefix}.qzeros"] = pack_cols(zeros, AWQ_ORDER)
            tensors[f"{prefix}.scales"] = scales.half()
            dequantized = (codes - zeros.repeat_interleave(GROUP, 0)).float() * scales.repeat_interleave(GROUP, 0)
            reference.get_parameter(name).data.copy_(dequantized.t())
        else:
            tensors[name] = param.contiguous()
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False, "desc_act": False}
        if method == "gptq"
        else {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return served_head(reference).eval()


@pytest.mark.parametrize(("method", "family"), [("gptq", "llama"), ("awq", "qwen2_tied")])
def test_a_packed_int4_checkpoint_is_served_quantized(
    method, family, checkpoint_factory, scripted, script, tmp_path
) -> None:
    _, hf = checkpoint_factory(family)
    reference = write_packed(hf, tmp_path / method, method)
    runner = ModelRunner(RunnerConfig(str(tmp_path / method), block_size=4, num_blocks=48))
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, Int4Weights) and qkv.weight is None and qkv.quant.group_size == GROUP
    assert_matches(runner, reference, prompts_for(hf.config.vocab_size), scripted, script)


def test_a_packed_checkpoint_dequantizes_by_its_definition_under_quantization_none(
    checkpoint_factory, tmp_path
) -> None:
    from conveyor.worker.loader import load_model

    _, hf = checkpoint_factory("llama")
    reference = write_packed(hf, tmp_path / "g", "gptq")
    model, _ = load_model(tmp_path / "g", quantization="none")
    got = model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(got, reference.model.layers[1].mlp.down_proj.weight, atol=1e-6, rtol=1e-6)
    rows = reference.model.layers[1].self_attn.k_proj.weight.shape[0]
    q = reference.model.layers[1].self_attn.q_proj.weight.shape[0]
    torch.testing.assert_close(
        model.layers[1].self_attn.qkv_proj.weight[q : q + rows], reference.model.layers[1].self_attn.k_proj.weight
    )


def test_an_unknown_quantization_method_is_refused_by_name(checkpoint_factory, tmp_path) -> None:
    from conveyor.worker.loader import load_model

    _, hf = checkpoint_factory("llama")
    write_packed(hf, tmp_path / "x", "gptq")
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (tmp_path / "x" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.quant_method 'bitsandbytes' is not supported"):
        load_model(tmp_path / "x")


# ------------------------------------------------------------------ compressed-tensors


def compressed_weight(w: torch.Tensor, scheme: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w`` ``[out, in]`` stored as ``scheme``: its tensors (suffix -> tensor) and the float
    weight they mean."""
    if scheme == "w4a16":  # symmetric int4 in groups of GROUP, stored + 8, eight per int32 along in
        g = w.reshape(w.shape[0], -1, GROUP)
        scale = (g.abs().amax(2) / 7).clamp_min(1e-6)
        q = torch.round(g / scale[..., None]).clamp(-8, 7)
        packed = pack_rows((q.reshape(w.shape) + 8).t().int()).t()
        return {"_packed": packed, "_scale": scale.half()}, (q * scale.half().float()[..., None]).reshape(w.shape)
    if scheme == "w8a16":  # symmetric int8 per channel
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-6)
        q = torch.round(w / scale).clamp(-127, 127)
        return {"": q.to(torch.int8), "_scale": scale}, q * scale
    per_channel = scheme == "fp8-channel"
    scale = (w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)) / 448
    values = (w / scale).to(torch.float8_e4m3fn)
    return {"": values, "_scale": scale}, values.float() * scale


SCHEMES = {  # scheme -> (format, weights args)
    "w4a16": (
        "pack-quantized",
        {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP},
    ),
    "w8a16": ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}),
    "fp8-tensor": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}),
    "fp8-channel": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
}


def write_compressed(hf: torch.nn.Module, directory, scheme: str) -> torch.nn.Module:
    reference = copy.deepcopy(hf)
    tensors = {}
    for name, param in hf.state_dict().items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            stored, dequantized = compressed_weight(param.float(), scheme)
            tensors.update({f"{name}{suffix}": t for suffix, t in stored.items()})
            reference.get_parameter(name).data.copy_(dequantized)
        elif not (name == "lm_head.weight" and hf.config.tie_word_embeddings):
            tensors[name] = param
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    fmt, weights = SCHEMES[scheme]
    config = hf.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return served_head(reference).eval()


@pytest.mark.parametrize(
    ("scheme", "method"),
    [("w4a16", "Int4Weights"), ("w8a16", "Int8Weights"), ("fp8-tensor", "Fp8Weights"), ("fp8-channel", "Fp8Weights")],
)
def test_a_compressed_tensors_checkpoint_is_served_quantized(
    scheme, method, checkpoint_factory, scripted, script, tmp_path
) -> None:
    _, hf = checkpoint_factory("llama")
    reference = write_compressed(hf, tmp_path / scheme, scheme)
    runner = ModelRunner(RunnerConfig(str(tmp_path / scheme), block_size=4, num_blocks=48))
    assert type(runner.model.layers[0].mlp.down_proj.quant).__name__ == method
    assert_matches(runner, reference, prompts_for(hf.config.vocab_size), scripted, script)
