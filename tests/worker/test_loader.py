"""The loader is strict: every expected tensor once, nothing unexpected, shapes exact; it
reads sharded checkpoints and refuses architectures it does not implement."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.worker.loader import load_model, resolve_dtype


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def edit_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(llama_dir, tmp_path):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_weights(directory, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(directory)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_weights(directory, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_model(directory)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_weights(directory, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\)"):
        load_model(directory)


def test_old_rotary_buffers_are_ignored(llama_dir, tmp_path):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    edit_weights(directory, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(directory)


def test_unsupported_architecture(tmp_path, llama_dir):
    directory = copy_checkpoint(llama_dir, tmp_path / "ckpt")
    config = (directory / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (directory / "config.json").write_text(config)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(directory)


def test_sharded_checkpoint_loads_the_same_weights(checkpoint_factory, tmp_path):
    directory, hf_model = checkpoint_factory("qwen3")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded, _ = load_model(tmp_path)
    single, _ = load_model(directory)
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters()):
        assert torch.equal(a, b), name


def test_loads_into_requested_dtype(llama_dir):
    model, config = load_model(llama_dir, "cpu", "bfloat16")
    assert model.dtype == torch.bfloat16
    assert resolve_dtype("auto", "cpu", config) == torch.float32
    assert resolve_dtype("auto", "cuda", config) == torch.float32  # the checkpoint was saved in float32
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", "cpu", config)
