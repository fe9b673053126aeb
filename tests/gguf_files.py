"""Tiny GGUF files written the way llama.cpp's converter writes them, for the GGUF tests.

:func:`write_gguf` turns a transformers Llama (or Qwen2/Qwen3/Gemma 3, or the mixtures of
experts Qwen3-MoE and Mixtral) into a GGUF file with ``gguf.GGUFWriter``: the ``{arch}.*``
metadata, the q/k rows of a Llama (and Mixtral) permuted into llama.cpp's interleaved rotary
order, a Gemma's norm weights stored as ``1 + w`` under its own names, each sparse layer's
experts stacked into ``ffn_{gate,up,down}_exps`` ``[experts, rows, columns]`` beside the router
``ffn_gate_inp`` with the ``expert_*`` counts (Mixtral as ``llama`` with experts), every matrix
quantized to one type by ``gguf.quants`` (norms, biases and the router stay F32, as llama.cpp
keeps them: :func:`stored_type`), and optionally the demo model's byte-level BPE tokenizer
with a chat template, so a file can be served end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # a sparse layer's router
    "mlp.experts.down_proj": "ffn_down_exps.weight",  # transformers' stacked [experts, hidden, width]
}
#: transformers' stacked [experts, 2 * width, hidden] gate and up rows -> llama.cpp's two tensors.
_GATE_UP = ("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"))
_GEMMA3_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt "
    "%}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{(_GEMMA3_LAYER if arch == 'gemma3' else {}).get(rest) or _LAYER[rest]}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: the two rotary halves of each head interleaved."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def stored_type(gguf_tensor: str, values: np.ndarray, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type ``write_gguf`` stores a tensor in: ``qtype`` for matrices and stacked experts
    (F16 when rows are not whole blocks of it, as llama.cpp's converter falls back), F32 for
    vectors and the router (llama.cpp never quantizes ``ffn_gate_inp``)."""
    if values.ndim < 2 or gguf_tensor.endswith("ffn_gate_inp.weight"):
        return GGMLQuantizationType.F32
    if values.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return GGMLQuantizationType.F16
    return qtype


def round_trip(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``values`` as a reader dequantizes them after they are stored as ``qtype`` (by the
    format's definition in ``gguf.quants``)."""
    if qtype == GGMLQuantizationType.F32:
        return values
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16).astype(np.float32)
    return dequantize(quantize(values, qtype), qtype).reshape(values.shape)


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    arch: str = "llama",
    tokenizer: bool = False,
    skip_metadata: tuple[str, ...] = (),
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_metadata: dict[str, tuple[str, Any]] | None = None,
    stacked_experts: bool = True,
) -> Path:
    """Write ``model`` (a transformers causal LM) as GGUF file ``path``; ``skip_metadata``
    leaves those keys out, ``extra_tensors`` adds raw tensors or replaces those of its names,
    ``extra_metadata`` adds ``key: (kind, value)`` (the error cases); ``stacked_experts``
    False writes one ``blk.N.ffn_{gate,up,down}.E.weight`` per expert, as llama.cpp's converter
    did before it stacked them."""
    config = model.config
    writer = GGUFWriter(str(path), arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = config.rope_parameters
    theta = (rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"]
    metadata: dict[str, Any] = {
        f"{arch}.block_count": ("uint32", config.num_hidden_layers),
        f"{arch}.context_length": ("uint32", config.max_position_embeddings),
        f"{arch}.embedding_length": ("uint32", config.hidden_size),
        f"{arch}.feed_forward_length": ("uint32", config.intermediate_size),
        f"{arch}.attention.head_count": ("uint32", heads),
        f"{arch}.attention.head_count_kv": ("uint32", kv_heads),
        f"{arch}.attention.key_length": ("uint32", head_dim),
        f"{arch}.attention.value_length": ("uint32", head_dim),
        f"{arch}.rope.dimension_count": ("uint32", head_dim),
        f"{arch}.rope.freq_base": ("float32", float(theta)),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", float(config.rms_norm_eps)),
        f"{arch}.vocab_size": ("uint32", config.vocab_size),
    }
    if arch == "gemma3":
        metadata[f"{arch}.attention.sliding_window"] = ("uint32", config.sliding_window)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # the converter's counts; Qwen's expert width (Mixtral's is feed_forward_length)
        metadata[f"{arch}.expert_count"] = ("uint32", experts)
        metadata[f"{arch}.expert_used_count"] = ("uint32", config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            metadata[f"{arch}.expert_feed_forward_length"] = ("uint32", config.moe_intermediate_size)
    metadata.update(extra_metadata or {})
    for key, (kind, value) in metadata.items():
        if key not in skip_metadata:
            getattr(writer, f"add_{kind}")(key, value)
    if tokenizer:
        _add_demo_tokenizer(writer)
    tensors: list[tuple[str, np.ndarray]] = []
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if name.endswith(_GATE_UP[0]):  # [experts, 2 * width, hidden]: gate rows, then up rows
            width = values.shape[1] // 2
            layer = name.split(".")[2]
            tensors += [(f"blk.{layer}.{suffix}", values[:, i * width : (i + 1) * width])
                        for i, suffix in enumerate(_GATE_UP[1])]  # fmt: skip
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = permute(values, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = permute(values, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            values = values + np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        tensors.append((gguf_name(name, arch), values))
    for gguf_tensor, values in tensors:
        if not stacked_experts and gguf_tensor.endswith("_exps.weight"):
            for expert, matrix in enumerate(values):  # blk.N.ffn_gate.E.weight ...
                expert_tensor = gguf_tensor.replace("_exps.weight", f".{expert}.weight")
                if expert_tensor not in (extra_tensors or {}):
                    _add(writer, expert_tensor, matrix, stored_type(expert_tensor, matrix, qtype))
        elif gguf_tensor not in (extra_tensors or {}):
            _add(writer, gguf_tensor, values, stored_type(gguf_tensor, values, qtype))
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: GGUFWriter, name: str, values: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, values)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(np.ascontiguousarray(values), qtype), raw_dtype=qtype)


def _add_demo_tokenizer(writer: GGUFWriter) -> None:
    """The demo tokenizer (byte-level BPE, Llama 3's pre-tokenizer) as llama.cpp's ``gpt2`` model."""
    spec = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {added["id"] for added in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
