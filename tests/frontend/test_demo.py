"""The demo model: committed tokenizer, torch-free checkpoint writer, race-safe cache directory."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from conveyor.checkpoints.demo import checkpoint as demo
from conveyor.frontend.tokenizer import Tokenizer


def test_demo_tokenizer_files_are_committed_and_small() -> None:
    for name in demo.TOKENIZER_FILES:
        path = demo.TOKENIZER_DIR / name
        assert path.is_file() and path.stat().st_size < 1_000_000


def test_demo_tokenizer_is_llama3_shaped(ours) -> None:
    tok = ours["demo"]
    assert tok.vocab_size == 4096
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4]) == specials
    assert tok.bos_token_id == 0 and tok.eos_token_id == 4
    ids = tok.encode("Return the value.")
    assert ids[0] == 0 and len(ids) <= 6  # BOS, then a few merged English tokens
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_write_demo_checkpoint(tmp_path) -> None:
    out = demo.write_demo_checkpoint(tmp_path / "ckpt", seed=3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == 4096 and config["bos_token_id"] == 0 and config["eos_token_id"] == 4
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is False
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 4]
    weights = load_file(str(out / "model.safetensors"))
    assert len(weights) == 2 + 1 + 4 * 9
    assert weights["model.embed_tokens.weight"].shape == (4096, 256)
    assert weights["lm_head.weight"].shape == (4096, 256)
    assert weights["model.layers.3.self_attn.q_proj.weight"].shape == (256, 256)
    assert weights["model.layers.3.self_attn.k_proj.weight"].shape == (128, 256)
    assert weights["model.layers.3.self_attn.o_proj.weight"].shape == (256, 256)
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (688, 256)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (256, 688)
    assert all(w.dtype == np.float32 for w in weights.values())
    assert np.array_equal(weights["model.norm.weight"], np.ones(256, np.float32))
    assert abs(float(weights["lm_head.weight"].std()) - 0.02) < 0.001
    assert Tokenizer.from_dir(out).encode("hello") == Tokenizer.from_dir(demo.TOKENIZER_DIR).encode("hello")
    # the seed fixes every value
    again = load_file(str(demo.write_demo_checkpoint(tmp_path / "again", seed=3) / "model.safetensors"))
    other = load_file(str(demo.write_demo_checkpoint(tmp_path / "other", seed=4) / "model.safetensors"))
    assert all(np.array_equal(weights[k], again[k]) for k in weights)
    assert not np.array_equal(weights["lm_head.weight"], other["lm_head.weight"])


def test_demo_checkpoint_dir_is_built_once_even_when_raced(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo.demo_checkpoint_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    target = results[0]
    assert target.parent == tmp_path / "cache" and target.name.startswith("demo-")
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no partial copies left
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert demo.demo_checkpoint_dir() == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
