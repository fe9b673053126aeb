"""Reading a GGUF checkpoint: its metadata as a Hugging Face ``config.json``, its tensors under
Hugging Face names, dequantized to float32.

GGUF (llama.cpp's single-file format) holds the config as ``{arch}.*`` metadata keys, the
tokenizer as ``tokenizer.*`` keys and every weight, often block-quantized (Q8_0, Q4_1, Q4_K
...). The `gguf` package (numpy only) parses the file and dequantizes each type it knows;
this module maps what it reads onto what the rest of Conveyor already understands, so
nothing downstream has a GGUF case: :func:`hf_config` gives the dicts
:meth:`~conveyor.checkpoints.model_config.ModelConfig.from_dicts` parses, :func:`hf_tensors`
the tensors under the names the worker's loader expects (a mixture of experts' stacked
expert tensors one per expert, :mod:`.experts`).

llama.cpp's converter permutes the rows of Llama's q and k projections (it rotates
interleaved pairs, HF rotates halves); :func:`unpermute` undoes it as transformers' GGUF
loader does, so the weights equal those transformers loads from the same file.

Everything that can be wrong with a file (not GGUF, truncated, an architecture, a metadata
field or a tensor type Conveyor cannot serve, a tensor it does not know) raises
:class:`GGUFError` naming the file and the field or tensor. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.checkpoints.gguf.errors import GGUFError
from conveyor.checkpoints.gguf.experts import (
    EXPERT_FIELD,
    check_expert_shapes,
    moe_config,
    per_expert_name,
    split_experts,
)
from conveyor.checkpoints.gguf.families import FAMILIES, Family, family_of_model_type
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

# general.architecture -> what sets it apart (q/k row order, names, norms, config keys)
ARCHITECTURES = FAMILIES

# GGUF tensor name -> HF name; per layer ({i}) and global.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")

# general.file_type -> the dtype a GPU serves it in by default (--dtype auto): a float file
# keeps its own; a quantized one is dequantized to bfloat16 (its values fit that range).
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def open_gguf(path: str | Path) -> GGUFReader:
    """The parsed file (memory-mapped: tensors are read when touched); GGUFError when ``path``
    is not a GGUF file or is cut short."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # numpy's reshape/index errors on a file cut short, gguf's own ValueErrors
        raise GGUFError(f"{path}: cannot parse it as GGUF, the file is truncated or corrupt ({exc})") from None


def hf_config(reader: GGUFReader, path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json`` and ``generation_config.json`` contents of the checkpoint, from its metadata.

    The keys transformers' GGUF loader reads (``{arch}.block_count`` -> ``num_hidden_layers``
    ...), tied embeddings exactly when the file has no ``output.weight``, the vocabulary size
    from ``{arch}.vocab_size`` or else the token list.
    """
    fields = _Fields(reader, path)
    arch, family = _family(fields, path)
    names = {t.name for t in reader.tensors}
    heads = fields.require(f"{arch}.attention.head_count")
    hidden = fields.require(f"{arch}.embedding_length")
    head_dim = fields.get(f"{arch}.attention.key_length") or hidden // heads
    rotary = fields.get(f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raise GGUFError(
            f"{path}: {arch}.rope.dimension_count {rotary} differs from the head size {head_dim} (partial rotary "
            "is not supported)"
        )
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in names:
        what = f"{arch}.rope.scaling.type {scaling!r}" if scaling not in (None, "none") else "tensor rope_freqs.weight"
        raise GGUFError(f"{path}: {what}: scaled RoPE from GGUF is not supported")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = fields.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise GGUFError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    eos = [fields.get(key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos += [tokens.index(text) for text in family.end_of_turn if tokens and text in tokens]
    eos = [token for i, token in enumerate(eos) if token is not None and token not in eos[:i]]
    bos = fields.get("tokenizer.ggml.bos_token_id")
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(fields.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(fields.require(f"{arch}.block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(fields.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(fields.require(f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": family.hidden_act,
        "torch_dtype": _FILE_DTYPES.get(fields.get("general.file_type"), "bfloat16"),
        "bos_token_id": bos,
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
    }
    if family.config is not None:
        config.update(family.config(arch, fields.get))
    if family.experts:
        config.update(moe_config(arch, family.architecture, fields.get, _shapes(reader), path))
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id") if config[key] is not None}
    return config, generation


def check_tensors(reader: GGUFReader, config: dict[str, Any], path: str | Path) -> None:
    """GGUFError for a tensor of a type `gguf` cannot dequantize or of a name Conveyor does not
    map, or a mixture of experts' router or stacked experts missing or of the wrong shape
    (``config``: :func:`hf_config`'s): all found before any weight is read."""
    _, family = _family(_Fields(reader, path), path)
    if family.experts:
        check_expert_shapes(config, _shapes(reader), path)
    for tensor in reader.tensors:
        hf_name(tensor.name, path, family)
        if not dequantizable(tensor.tensor_type):
            raise GGUFError(
                f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf package cannot "
                "dequantize"
            )


def hf_tensors(reader: GGUFReader, config: dict[str, Any], path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout) for every tensor, one at a time (each is
    dequantized when reached, so at most one dequantized copy is alive)."""
    for name, tensor, heads, offset in raw_tensors(reader, config, path):
        values = dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape(tuple(reversed([int(d) for d in tensor.shape])))
        values = values if heads is None else unpermute(values, heads)
        yield name, values - np.float32(offset) if offset else values


def raw_tensors(
    reader: GGUFReader, config: dict[str, Any], path: str | Path
) -> Iterator[tuple[str, Any, int | None, float]]:
    """(HF name, the file's tensor as stored, the head count whose rotary row order
    :func:`unpermute` must undo or None, what to subtract from its dequantized values: a
    Gemma norm's 1, else 0) for every tensor: what a reader keeping the blocks quantized
    starts from. A stacked expert tensor comes as one 2-D tensor per expert, under that
    expert's name (:func:`~.experts.split_experts`)."""
    family = family_of_model_type(config["model_type"])
    for tensor in reader.tensors:
        name = hf_name(tensor.name, path, family)
        if EXPERT_FIELD in name:
            for expert, part in split_experts(tensor):
                yield name.replace(EXPERT_FIELD, str(expert)), part, None, 0.0
            continue
        heads = None
        if family.permuted_qk and name.endswith("self_attn.q_proj.weight"):
            heads = config["num_attention_heads"]
        elif family.permuted_qk and name.endswith("self_attn.k_proj.weight"):
            heads = config["num_key_value_heads"]
        offset = family.norm_offset if name.endswith("norm.weight") else 0.0
        yield name, tensor, heads, offset


def hf_name(name: str, path: str | Path, family: Family) -> str:
    """The HF name of GGUF tensor ``name`` in a file of ``family``; GGUFError for one Conveyor
    does not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    suffix = match.group(2) if match else None
    if suffix in family.layer_names or suffix in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{family.layer_names.get(suffix) or _LAYER_NAMES[suffix]}"
    if family.experts and (expert := per_expert_name(suffix, family.architecture)):
        return f"model.layers.{match.group(1)}.{expert}"
    raise GGUFError(f"{path}: tensor {name} has no counterpart in Conveyor's models")


def _family(fields: _Fields, path: str | Path) -> tuple[str, Family]:
    """The file's ``general.architecture`` and its family; GGUFError when missing or unknown."""
    arch = fields.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{path}: metadata field general.architecture is missing")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: general.architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    family = ARCHITECTURES[arch]
    if family.sparse is not None and fields.get(f"{arch}.expert_count"):
        return arch, family.sparse
    return arch, family


def _shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in HF order (GGUF lists dimensions innermost first), by GGUF name."""
    return {t.name: tuple(reversed([int(d) for d in t.shape])) for t in reader.tensors}


@cache
def dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether `gguf` dequantizes ``qtype``: tried on one block of zeros."""
    if qtype not in GGML_QUANT_SIZES or qtype in _INTEGER_TYPES:
        return False
    _, type_size = GGML_QUANT_SIZES[qtype]
    block = np.zeros((1, type_size), dtype=np.uint8)
    try:
        if qtype == GGMLQuantizationType.F32:
            dequantize(block.view(np.float32), qtype)
        elif qtype == GGMLQuantizationType.F16:
            dequantize(block.view(np.float16), qtype)
        else:
            dequantize(block, qtype)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


_INTEGER_TYPES = {getattr(GGMLQuantizationType, name) for name in ("I8", "I16", "I32", "I64", "F64")}


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head it stores the rotary pairs
    interleaved (row 2j, 2j+1), HF stores the two halves one after the other."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


class _Fields:
    """Metadata values by key, plain Python values (str, int, float, list)."""

    def __init__(self, reader: GGUFReader, path: str | Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str) -> Any:
        field = self._fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as exc:
            raise GGUFError(f"{self._path}: metadata field {key} cannot be read ({exc})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self._path}: metadata field {key} is missing")
        return value
