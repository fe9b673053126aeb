"""The built-in demo model: a small Llama checkpoint with RANDOM weights and a real tokenizer.

``bin/serve`` with no ``--model`` serves this, so the whole system (tokenizer, scheduler,
worker, kernels) runs on a fresh machine with nothing downloaded. Its weights are seeded
random numbers, so its output is gibberish; everything else about it is a standard HF
checkpoint (``config.json``, ``generation_config.json``, ``model.safetensors`` with the
usual Llama tensor names, the tokenizer files), loadable by transformers too.

It is written without torch (numpy + ``safetensors.numpy``), so the processes that must
not import torch can build it. :func:`demo_checkpoint_dir` builds it once per cache
directory; the directory name is a hash of everything that determines its contents, so a
changed tokenizer or architecture gets a new directory, never a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

TOKENIZER_DIR = Path(__file__).resolve().parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Bump when the layout or initialization below changes, so caches built before are not reused.
FORMAT_VERSION = 1
DEMO_SEED = 0
INIT_STD = 0.02
ARCHITECTURE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 688,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
END_OF_TEXT = "<|end_of_text|>"
END_OF_TURN = "<|eot_id|>"


def demo_config() -> dict:
    """config.json of the demo model: :data:`ARCHITECTURE` plus what the tokenizer decides."""
    tok = _tokenizer()
    tok_config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **ARCHITECTURE,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "bos_token_id": tok.token_to_id(tok_config["bos_token"]),
        "eos_token_id": tok.token_to_id(tok_config["eos_token"]),
        "torch_dtype": "float32",
    }


def demo_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under HF Llama names: N(0, INIT_STD) matrices, unit norms.

    Tensors are drawn in the order listed here from one seeded generator, so a seed fixes
    every value.
    """
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(INIT_STD)

    def norm() -> np.ndarray:
        return np.ones(hidden, dtype=np.float32)

    weights = {"model.embed_tokens.weight": matrix(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        weights[f"{layer}.self_attn.q_proj.weight"] = matrix(q_dim, hidden)
        weights[f"{layer}.self_attn.k_proj.weight"] = matrix(kv_dim, hidden)
        weights[f"{layer}.self_attn.v_proj.weight"] = matrix(kv_dim, hidden)
        weights[f"{layer}.self_attn.o_proj.weight"] = matrix(hidden, q_dim)
        weights[f"{layer}.mlp.gate_proj.weight"] = matrix(inter, hidden)
        weights[f"{layer}.mlp.up_proj.weight"] = matrix(inter, hidden)
        weights[f"{layer}.mlp.down_proj.weight"] = matrix(hidden, inter)
        weights[f"{layer}.input_layernorm.weight"] = norm()
        weights[f"{layer}.post_attention_layernorm.weight"] = norm()
    weights["model.norm.weight"] = norm()
    weights["lm_head.weight"] = matrix(vocab, hidden)
    return weights


def write_demo_checkpoint(path: str | Path, seed: int = 0, weights: dict[str, np.ndarray] | None = None) -> Path:
    """Write the demo checkpoint into directory ``path`` (created if needed) and return it;
    ``weights`` (the names and shapes of :func:`demo_weights`) replace the seeded random ones."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = demo_config()
    tok = _tokenizer()
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [tok.token_to_id(END_OF_TEXT), tok.token_to_id(END_OF_TURN)],
    }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    weights = demo_weights(config, seed) if weights is None else weights
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / name, out / name)
    return out


def demo_checkpoint_dir() -> Path:
    """The demo checkpoint in the cache (``$CONVEYOR_CACHE`` or ``~/.cache/conveyor``), built on first use."""
    return cached_checkpoint_dir(f"demo-{demo_fingerprint()}", lambda path: write_demo_checkpoint(path, DEMO_SEED))


def cached_checkpoint_dir(name: str, write: Callable[[Path], object]) -> Path:
    """Directory ``name`` of the cache (``$CONVEYOR_CACHE`` or ``~/.cache/conveyor``), written
    by ``write(directory)`` on first use; ``name`` must change with whatever decides the contents.

    It is written to a temporary sibling directory and renamed into place, so a reader
    sees either no directory or a complete one; when two processes race, one rename wins
    and the other's copy is discarded.
    """
    root = Path(os.environ.get("CONVEYOR_CACHE") or Path.home() / ".cache" / "conveyor").expanduser()
    target = root / name
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def demo_fingerprint() -> str:
    """Short hash of the builder's parameters and the tokenizer files: names one cache entry."""
    h = hashlib.sha256()
    params = {"format": FORMAT_VERSION, "architecture": ARCHITECTURE, "init_std": INIT_STD, "seed": DEMO_SEED}
    h.update(json.dumps(params, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        h.update((TOKENIZER_DIR / name).read_bytes())
    return h.hexdigest()[:12]


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
