"""Quantized weights: each method's kernel against a float32 product with its dequantized
weight; tiny models quantized at load (int8, int4, fp8) and a GGUF Q4_1 file kept quantized,
greedy against transformers running a float32 copy whose weights the test dequantized by the
format's definition (written here, not taken from the loader); LoRA on a quantized base; the
tensor-parallel group check.

The kernels quantize activations too (int8: per token; int4: bfloat16; fp8: e4m3 per token),
so greedy runs are compared with the bfloat16 tie rule of :mod:`tests.worker.parity`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from conveyor.runtime.config import RunnerConfig
from conveyor.runtime.tensor_shards import TensorParallel
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.quantization.gguf_blocks import decode_blocks
from conveyor.worker.quantization.loading import quantize_linears
from conveyor.worker.quantization.methods import Fp8Weights, Int4Weights, Int8Weights
from conveyor.worker.quantization.tensors import QuantizedTensor, quantize_int4
from tests.gguf_files import permute, write_gguf
from tests.lora_adapters import make_adapter
from tests.worker.parity import assert_greedy_agrees, hf_greedy_with_logits

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------- the definitions, written from the formats


def int8_by_definition(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def int4_by_definition(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    g = w.reshape(w.shape[0], -1, group)
    low, high = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
    # the scale and the value of code 8 (low + 8 scale) are bfloat16 numbers (exact in the CPU kernel)
    scale = ((high - low) / 15).clamp_min(1e-12).bfloat16().float()
    low = (low + 8 * scale).bfloat16().float() - 8 * scale
    return (torch.round((g - low) / scale).clamp(0, 15) * scale + low).reshape(w.shape)


def fp8_by_definition(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(1, keepdim=True) / 448
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def gguf_by_definition(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> torch.Tensor:
    """ggml's block layouts: Q8_0 = f16 d + 32 int8 (d q); Q4_0 = f16 d + 16 bytes, element j
    in byte j's low nibble and j + 16 in its high one (d (q - 8)); Q4_1 = f16 d, f16 m, the same
    nibbles (d q + m)."""
    rows, cols = shape
    out = np.zeros((rows, cols), np.float32)
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    data = raw.reshape(rows, cols // 32, size)
    for r in range(rows):
        for b in range(cols // 32):
            block = data[r, b].tobytes()
            d = float(np.frombuffer(block[:2], np.float16)[0])
            if qtype == Q.Q8_0:
                values = d * np.frombuffer(block[2:], np.int8).astype(np.float32)
            else:
                head = 2 if qtype == Q.Q4_0 else 4
                nibbles = np.frombuffer(block[head:], np.uint8)
                q = np.concatenate([nibbles & 15, nibbles >> 4]).astype(np.float32)
                values = d * (q - 8) if qtype == Q.Q4_0 else d * q + float(np.frombuffer(block[2:4], np.float16)[0])
            out[r, b * 32 : (b + 1) * 32] = values
    return torch.from_numpy(out)


def dequantized_copy(hf: torch.nn.Module, rule) -> torch.nn.Module:
    """``hf`` with every projection's weight replaced by ``rule(weight)`` and its LM head as
    every scheme serves it (:func:`served_head`)."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in ref.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                module.weight.copy_(rule(module.weight.float()))
    return served_head(ref).eval()


@torch.no_grad()
def served_head(ref: torch.nn.Module) -> torch.nn.Module:
    """``ref`` with a separate LM head replaced by the int8 head every scheme serves; a tied
    head stays the float embedding."""
    if not ref.config.tie_word_embeddings:
        head = ref.get_output_embeddings()
        head.weight.copy_(int8_by_definition(head.weight))
    return ref


# --------------------------------------------------------------------------- the methods


@pytest.mark.parametrize("rows", [0, 1, 7])
@pytest.mark.parametrize("method", ["int8", "int4-asym", "int4-sym-g64", "fp8"])
def test_each_method_multiplies_by_its_dequantized_weight(method, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = 40, 128  # 40 rows: not a multiple of the CPU int4 kernel's 16
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    if method == "fp8":
        layer = Fp8Weights.quantize(torch.randn(n, k, generator=gen), "cpu")
        weight, tolerance = layer.weight.float() * layer.scales.reshape(-1, 1), 0.08
    else:
        group = 64 if method.endswith("g64") else (32 if method.startswith("int4") else k)
        bits = 8 if method == "int8" else 4
        codes = (
            torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
            if bits == 8
            else torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
        )
        scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
        offsets = (
            None
            if bits == 8
            else (
                -8 * scales
                if "sym" in method and "asym" not in method
                else torch.randn(n, k // group, generator=gen) * 0.1
            )
        )
        q = QuantizedTensor(codes, scales, offsets, bits, group)
        layer = (Int8Weights if bits == 8 else Int4Weights)(q, "cpu")
        weight = codes.float() * scales.repeat_interleave(group, 1) + (
            0 if offsets is None else offsets.repeat_interleave(group, 1)
        )
        tolerance = 0.02  # int8 activations per token / bfloat16 activations and scales
    want = x @ weight.t() + bias
    got = layer.apply(x, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    if rows:
        assert (got - want).abs().max() <= tolerance * want.abs().max()


def test_cpu_int4_keeps_float32_activations_and_f16_scales_to_the_output_rounding() -> None:
    """GGUF's f16 scales and offsets (not bfloat16 numbers) and float32 activations through the
    bfloat16 kernel: each output is the float64 product up to its own bfloat16 rounding (the
    kernel's output), not the activations' or the scales' (what cost Q4_1 most of its agreement)."""
    gen = torch.Generator().manual_seed(11)
    n, k, rows = 48, 256, 5
    codes = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005).half().float()
    offsets = (-8 * scales + torch.randn(n, k // 32, generator=gen) * 0.01).half().float()
    layer = Int4Weights(QuantizedTensor(codes, scales, offsets, 4, 32), "cpu")
    assert layer.scale_zeros_residual is not None  # f16 scales need the residual call
    weight = QuantizedTensor(codes, scales, offsets, 4, 32).dequantize().double()
    x = torch.randn(rows, k, generator=gen)
    want = x.double() @ weight.t()
    got = layer.apply(x, None).double()
    assert ((got - want).abs() <= 2**-8 * want.abs() + 1e-6 * want.abs().max()).all()


def test_our_int4_scales_need_no_residual_call() -> None:
    """quantize_int4 rounds the scale and the kernel's zero to bfloat16 numbers, so the CPU
    layer makes one kernel call (no residual) and still multiplies by exactly its codes."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    q = quantize_int4(weight, 32)
    layer = Int4Weights(q, "cpu")
    assert layer.scale_zeros_residual is None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    want = x.double() @ q.dequantize().double().t()
    got = layer.apply(x, None).double()
    assert ((got - want).abs() <= 2**-8 * want.abs() + 1e-6 * want.abs().max()).all()


# -------------------------------------------------------------------- whole models


def greedy(runner: ModelRunner, scripted, script, prompts, max_new: int, lora=None) -> dict[str, list[int]]:
    scripts = [
        script(f"r{i}", p, max_new=max_new, chunk=5 if i % 2 else None, lora=lora) for i, p in enumerate(prompts)
    ]
    return scripted(runner, scripts).run()


def assert_matches(runner, reference, prompts, scripted, script, max_new=6, lora=None) -> None:
    outputs = greedy(runner, scripted, script, prompts, max_new, lora)
    for i, prompt in enumerate(prompts):
        want, logits = hf_greedy_with_logits(reference, prompt, max_new)
        assert_greedy_agrees(outputs[f"r{i}"], want, logits, torch.bfloat16, min_compared=1, label=f"r{i}")


def prompts_for(vocab: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 12, 4)]


RULES = {
    "int8": (int8_by_definition, Int8Weights),
    "int4": (int4_by_definition, Int4Weights),
    "fp8": (fp8_by_definition, Fp8Weights),
}


@pytest.mark.parametrize(
    ("family", "scheme"), [("llama", "int8"), ("qwen2_tied", "int4"), ("llama", "int4"), ("qwen3", "fp8")]
)
def test_a_float_checkpoint_quantized_at_load_generates_as_its_dequantized_weights(
    family, scheme, checkpoint_factory, scripted, script
) -> None:
    directory, hf = checkpoint_factory(family)
    rule, method = RULES[scheme]
    runner = ModelRunner(RunnerConfig(directory, block_size=4, num_blocks=48, quantization=scheme))
    mlp = runner.model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj.quant, method) and mlp.gate_up_proj.weight is None
    # (seed 7: seed 3 puts llama-int4 at a near-tie on its first token)
    assert_matches(runner, dequantized_copy(hf, rule), prompts_for(hf.config.vocab_size, 7), scripted, script)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_decode_as_the_format_defines(qtype) -> None:
    gen = np.random.default_rng(int(qtype))
    values = (gen.standard_normal((6, 96)) * 0.2).astype(np.float32)
    raw = quantize(values, qtype)
    decoded = decode_blocks(raw, qtype, 6, 96)
    assert decoded.bits == (8 if qtype == Q.Q8_0 else 4) and decoded.group_size == 32
    assert torch.equal(decoded.dequantize(), gguf_by_definition(raw, qtype, (6, 96)))


def test_a_k_quant_is_requantized_to_int4_groups() -> None:
    """Q4_K (which `gguf` reads but cannot write): random blocks with sane f16 super-scales,
    served as int4 in groups of 32 of the values `gguf` dequantizes."""
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (4, 144), dtype=np.uint8)  # one 256-weight super-block per row
    raw[:, :4] = np.frombuffer(np.array([0.01, 0.005], np.float16).tobytes() * 1, np.uint8)
    decoded = decode_blocks(raw, Q.Q4_K, 4, 256)
    assert decoded.bits == 4 and decoded.group_size == 32
    want = int4_by_definition(torch.from_numpy(dequantize(raw, Q.Q4_K)).float())
    torch.testing.assert_close(decoded.dequantize(), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    """A tiny Llama as a Q4_1 GGUF file, and transformers on its weights dequantized by the
    format's definition (projections; the Q4_1 embedding also as the int8 head)."""
    from tests.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("q41")
    hf = make_checkpoint("llama", root / "hf")
    path = write_gguf(root / "tiny.Q4_1.gguf", hf, Q.Q4_1)
    heads, kv_heads = hf.config.num_attention_heads, hf.config.num_key_value_heads
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if param.dim() != 2:
                continue
            values = param.float().numpy()
            order = heads if name.endswith("q_proj.weight") else kv_heads if name.endswith("k_proj.weight") else None
            stored = permute(values, order) if order else values  # as the file holds it
            dq = gguf_by_definition(quantize(stored, Q.Q4_1), Q.Q4_1, stored.shape).numpy()
            if order:  # back to HF's row order
                dq = dq.reshape(order, dq.shape[0] // order // 2, 2, -1).swapaxes(1, 2).reshape(dq.shape)
            param.copy_(torch.from_numpy(dq))
        ref.lm_head.weight.copy_(int8_by_definition(ref.lm_head.weight))
    return path, ref.eval()


def test_a_q4_1_gguf_is_served_as_int4_with_quantization_gguf(q4_1_file, scripted, script, tmp_path) -> None:
    import json

    from conveyor.checkpoints.gguf.prepare import POINTER
    from conveyor.checkpoints.gguf.reader import hf_config, open_gguf

    path, reference = q4_1_file
    config, _ = hf_config(open_gguf(path), path)  # the prepared directory, less the tokenizer this file lacks
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / POINTER).write_text(json.dumps({"path": str(path)}))
    default = ModelRunner(RunnerConfig(str(tmp_path), block_size=4, num_blocks=48))
    assert default.model.layers[1].self_attn.qkv_proj.quant is None  # auto: dequantized, as transformers reads it
    runner = ModelRunner(RunnerConfig(str(tmp_path), block_size=4, num_blocks=48, quantization="gguf"))
    qkv = runner.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv.quant, Int4Weights) and qkv.weight is None
    assert runner.model.embed_tokens.weight.dtype == torch.float32  # the embedding is looked up in float
    assert_matches(runner, reference, prompts_for(reference.config.vocab_size), scripted, script)


def test_lora_on_a_quantized_base_matches_peft_on_the_dequantized_base(
    checkpoint_factory, scripted, script, tmp_path
) -> None:
    directory, hf = checkpoint_factory("llama")
    reference = dequantized_copy(hf, int8_by_definition)
    peft = make_adapter(reference, tmp_path / "adapter", seed=0, rank=8, alpha=16.0)
    runner = ModelRunner(
        RunnerConfig(directory, block_size=4, num_blocks=48, quantization="int8", enable_lora=True, max_loras=1,
                     max_lora_rank=8, lora_modules=(("a", str(tmp_path / "adapter")),))
    )  # fmt: skip
    assert_matches(runner, peft, prompts_for(hf.config.vocab_size), scripted, script, lora="a")


def test_a_group_straddling_a_tensor_parallel_shard_is_refused(checkpoint_factory) -> None:
    """Two ranks share intermediate_size 96 as 48 features each: int4 groups of 32 cannot
    split them, and the message says which layer and what to do."""
    from conveyor.checkpoints.model_config import ModelConfig
    from conveyor.worker.attention.triton_backend import backend_for
    from conveyor.worker.models.registry import model_class

    directory, _ = checkpoint_factory("llama")
    config = ModelConfig.from_dir(directory)
    model = model_class(config.architecture)(
        config, backend_for("cpu"), torch.float32, "cpu", TensorParallel(0, 2, None)
    )
    with pytest.raises(
        ValueError, match=r"--quantization int4: layers\.0\.mlp\.down_proj has 48 input features .* group of 32"
    ):
        quantize_linears(model, "int4")
    quantize_linears(model, "int8")  # per channel: any shard


def test_a_layer_of_mixed_parts_is_served_as_int8_per_channel() -> None:
    """A fused layer whose pieces the file stores in different types (q as Q4_1, v as Q8_0,
    as llama.cpp's mixed files do): one int8 per-channel weight of each piece's values."""
    from conveyor.worker.quantization.loading import PendingWeight

    gen = np.random.default_rng(5)
    top, bottom = (gen.standard_normal((n, 64)).astype(np.float32) * 0.2 for n in (32, 16))
    pending = PendingWeight("checkpoint", 48, 64)
    pending.add(32, decode_blocks(quantize(bottom, Q.Q8_0), Q.Q8_0, 16, 64))
    pending.add(0, decode_blocks(quantize(top, Q.Q4_1), Q.Q4_1, 32, 64))
    assert pending.complete
    layer = pending.build("cpu")
    assert isinstance(layer, Int8Weights)
    values = torch.cat(
        [
            gguf_by_definition(quantize(top, Q.Q4_1), Q.Q4_1, (32, 64)),
            gguf_by_definition(quantize(bottom, Q.Q8_0), Q.Q8_0, (16, 64)),
        ]
    )
    torch.testing.assert_close(layer.codes.float() * layer.scales[:, None], int8_by_definition(values))


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("rows", [1, 40])
@CUDA[0]
@CUDA[1]
def test_each_method_on_cuda_multiplies_by_its_dequantized_weight(method, rows) -> None:
    """The CUDA layouts and kernels (Triton dequantize-GEMM; ``_scaled_mm`` for fp8, sm_89+)."""
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89 or newer")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 128, generator=gen) * 0.1
    x, bias = torch.randn(rows, 128, generator=gen), torch.randn(96, generator=gen)
    if method == "fp8":
        layer, want_weight = Fp8Weights.quantize(weight, "cuda"), fp8_by_definition(weight)
    elif method == "int8":
        from conveyor.worker.quantization.tensors import quantize_int8

        layer, want_weight = Int8Weights(quantize_int8(weight), "cuda"), int8_by_definition(weight)
    else:
        from conveyor.worker.quantization.tensors import quantize_int4

        layer, want_weight = Int4Weights(quantize_int4(weight, 32), "cuda"), int4_by_definition(weight)
    want = x @ want_weight.t() + bias
    got = layer.apply(x.cuda(), bias.cuda()).cpu()
    tolerance = 0.08 if method == "fp8" else 1e-3
    assert (got - want).abs().max() <= tolerance * want.abs().max()


def test_a_weight_update_of_a_quantized_model_is_quantized_as_its_load_was(tmp_path) -> None:
    """worker/weight_updates on an int4 model: the new float weights are quantized like a
    fresh int4 load of them (same codes and scales), not copied into absent float weights."""
    from transformers import LlamaConfig

    from conveyor.worker.loader import load_model
    from conveyor.worker.weight_updates import update_from_disk
    from tests.checkpoints import SMALL, build

    config = LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"], tie_word_embeddings=True)
    build(config, tmp_path / "old", seed=1)
    build(config, tmp_path / "new", seed=2)
    model, _ = load_model(tmp_path / "old", quantization="int4")
    update_from_disk(model, tmp_path / "new")
    fresh, _ = load_model(tmp_path / "new", quantization="int4")
    for ours, theirs in zip(model.modules(), fresh.modules()):
        if getattr(ours, "quant", None) is not None:
            assert torch.equal(ours.quant.packed, theirs.quant.packed) and torch.equal(
                ours.quant.scale_zeros, theirs.quant.scale_zeros
            )
    assert torch.equal(model.embed_tokens.weight, fresh.embed_tokens.weight)


def test_batch_invariant_mode_refuses_quantized_weights(checkpoint_factory) -> None:
    from conveyor.worker.batch_invariant import make_batch_invariant
    from conveyor.worker.loader import load_model

    model, _ = load_model(checkpoint_factory("llama")[0], quantization="int8")
    with pytest.raises(
        ValueError,
        match="--batch-invariant with quantized weights \\(int8\\) is not supported: use --quantization none",
    ):
        make_batch_invariant(model)
