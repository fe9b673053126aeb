"""The 8-bit KV cache (``kv_cache_dtype`` fp8 / int8) in the worker, on tiny checkpoints.

* Logits against transformers' with the same quantization done by definition: HF's rotated
  keys and its values passed through :func:`~conveyor.worker.attention.kv_quant.to_cache` and
  back at our calibrated per-layer scales. Both sides then compute the same function, so the
  tolerance is the float path's (1e-4 on logits, as tests/worker/test_model.py): a missing
  scale, a key quantized before its rotation, or a prefix read as stored would each move the
  logits by far more (tiny checkpoints' plain-float logits sit 0.2-1.3 away in log-probability
  from the 8-bit ones, so quantization is not a rounding detail there). A chunked prefill reads
  its first chunk's KV back from the 8-bit cache.
* The torch backends (batched, reference, batch-invariant) against the float32 oracle on a
  dequantized random cache.
* The pool: at equal memory an 8-bit cache holds exactly twice the blocks of a 16-bit one
  (four times float32's), and a runner reports it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral

from conveyor.runtime.config import RunnerConfig
from conveyor.worker.attention.backend import AttentionLayer, AttentionMetadata
from conveyor.worker.attention.kv_quant import FP8, KVScales, from_cache, to_cache
from conveyor.worker.attention.torch_invariant import TorchInvariantAttention
from conveyor.worker.attention.triton_backend import backend_for
from conveyor.worker.kv_cache import KVCacheShape
from conveyor.worker.kv_calibration import calibrate_kv_scales
from conveyor.worker.loader import load_model
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.models.layers import RotaryEmbedding
from conveyor_tools.kernels.testing import assert_attention_close, paged_attention_ref
from tests.worker.test_model import forward_logits

DTYPES = {"fp8": FP8, "int8": torch.int8}
MODULES = {"llama": modeling_llama, "mistral_window": modeling_mistral}


def _fake_quant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return from_cache(to_cache(x, 1.0 / scale, dtype), scale).to(x.dtype)


def _hf_logprobs(hf_model, module, prompt: list[int], scales: list[KVScales], dtype: torch.dtype) -> torch.Tensor:
    """HF's log-probabilities with every layer's rotated keys and values quantized to the cache
    and back (layers run in order, so the n-th rotation is layer n % layers's)."""
    rotate = module.apply_rotary_pos_emb
    calls = itertools.count()

    def quantized_rotation(q, k, cos, sin, *args, **kwargs):
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        return q, _fake_quant(k, scales[next(calls) % len(scales)].k, dtype)

    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out, s=layer_scales: _fake_quant(out, s.v, dtype))
        for layer, layer_scales in zip(hf_model.model.layers, scales)
    ]
    module.apply_rotary_pos_emb = quantized_rotation
    try:
        with torch.no_grad():
            return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    finally:
        module.apply_rotary_pos_emb = rotate
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("kv", sorted(DTYPES))
@pytest.mark.parametrize("attention", ["torch", "torch-ref"])
def test_logits_match_transformers_quantized_by_definition(checkpoint_factory, name, kv, attention):
    directory, hf_model = checkpoint_factory(name)
    model, config = load_model(directory, "cpu", "auto", backend_for("cpu", attention))
    shape = KVCacheShape.of(config, 4, DTYPES[kv])
    scales = calibrate_kv_scales(model, shape, DTYPES[kv])
    assert scales is not None and len(scales) == config.num_layers
    model.bind_kv_cache(shape.allocate(16, "cpu"), scales)
    assert model.attention_layers()[0].cache.dtype == DTYPES[kv]
    prompt = torch.randint(0, config.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    table = [7, 2, 11, 0]
    first = forward_logits(model, 4, [6], [0], [table], prompt[:6])
    second = forward_logits(model, 4, [8], [6], [table], prompt[6:])  # reads the first chunk's 8-bit KV
    ours = torch.cat([first, second]).log_softmax(-1)

    want = _hf_logprobs(hf_model, MODULES[name], prompt, scales, DTYPES[kv])
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        plain = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert (ours - plain).abs().max() > 1e-2  # the quantization is real, and far above the tolerance


@pytest.mark.parametrize("kv", sorted(DTYPES))
@pytest.mark.parametrize("backend", ["torch", "torch-ref", "invariant"])
def test_torch_backends_dequantize(kv, backend):
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size = 8, 2, 16, 4
    spans = [(0, 7), (9, 1), (5, 4), (17, 1)]
    seq_lens = [c + q for c, q in spans]
    tables = torch.randperm(32, generator=gen)[: sum(-(-n // block_size) for n in seq_lens)].tolist()
    table_rows, taken = [], 0
    for n in seq_lens:
        table_rows.append(tables[taken : taken + -(-n // block_size)])
        taken += len(table_rows[-1])
    scales = KVScales(0.03, 0.02)
    cache = to_cache(3 * torch.randn(2, 32, block_size, kv_heads, head_dim, generator=gen), 1 / 0.03, DTYPES[kv])
    cache[1] = to_cache(from_cache(cache[1], 0.03), 1 / 0.02, DTYPES[kv])  # (values at their own scale)
    query = torch.randn(sum(q for _, q in spans), heads, head_dim, generator=gen)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, "cpu")
    layer = AttentionLayer(heads, kv_heads, head_dim, head_dim**-0.5, None, rotary, kv_cache=cache, kv_scales=scales)
    metadata = AttentionMetadata.build([q for _, q in spans], [c for c, _ in spans], table_rows, block_size, "cpu")
    attention = TorchInvariantAttention() if backend == "invariant" else backend_for("cpu", backend)
    out = attention.forward(layer, query, metadata)

    width = max(len(row) for row in table_rows)
    padded = torch.tensor([row + [0] * (width - len(row)) for row in table_rows], dtype=torch.int32)
    dequantized = torch.stack([from_cache(cache[0], scales.k), from_cache(cache[1], scales.v)])
    assert_attention_close(out, paged_attention_ref(query, dequantized, padded, spans, layer.scale), torch.float32)


@pytest.mark.parametrize(
    ("dtype", "kv", "factor"), [(torch.bfloat16, "fp8", 2), (torch.bfloat16, "int8", 2), (torch.float32, "fp8", 4)]
)
def test_pool_holds_more_blocks_in_the_same_memory(llama_dir, dtype, kv, factor):
    """``kv_cache_memory_bytes`` buys ``factor`` times the blocks (the worker reports
    ``num_blocks`` to the scheduler, which sizes its pool from it)."""
    memory = 3 << 20

    def runner(kv_cache_dtype: str) -> ModelRunner:
        return ModelRunner(
            RunnerConfig(
                llama_dir, dtype=dtype, block_size=16, kv_cache_memory_bytes=memory, kv_cache_dtype=kv_cache_dtype
            )
        )

    full, small = runner("auto"), runner(kv)
    assert small.block_bytes * factor == full.block_bytes
    assert small.num_blocks == factor * full.num_blocks == factor * (memory // full.block_bytes)
    assert small.kv_caches[0].dtype == DTYPES[kv] and small.kv_caches[0].shape[1] == small.num_blocks


def test_every_face_names_it():
    """bin/serve's flag, the engine's option and the runner's config carry ``kv_cache_dtype``;
    a bad name is refused, naming the field."""
    from conveyor.assembly import build
    from conveyor.cli import serve
    from conveyor.engine.options import EngineOptions

    assert serve.build_parser().parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--kv-cache-dtype", "fp4"])
    assert build.worker_settings(EngineOptions(kv_cache_dtype="fp8").settings())["kv_cache_dtype"] == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, int8, got 'fp4'"):
        RunnerConfig("unused", kv_cache_dtype="fp4")
