"""ModelConfig parses both generations of config.json into one view (torch-free)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conveyor.checkpoints.model_config import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def parse(overrides: dict, generation: dict | None = None) -> ModelConfig:
    return ModelConfig.from_dicts({**BASE, **overrides}, generation)


def test_module_does_not_import_torch():
    code = "import sys, conveyor.checkpoints.model_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defaults():
    config = parse({})
    assert config.head_dim == 16 and config.num_kv_heads == 2
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert not (config.attention_bias or config.o_proj_bias or config.qk_norm or config.tie_word_embeddings)
    assert config.sliding_window is None and config.layer_sliding_window(1) is None
    assert config.torch_dtype == "float32" and config.eos_token_ids == [] and config.bos_token_id is None


def test_old_and_new_rope_formats_agree():
    old = parse({"rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "rope_type": "llama3"}})
    new = parse({"rope_parameters": {**LLAMA3, "rope_type": "llama3", "rope_theta": 500000.0}})
    assert old == new
    assert old.rope_theta == 500000.0 and old.rope_scaling == {"rope_type": "llama3", **LLAMA3}
    linear = parse({"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = parse({"rope_theta": 1e6, "rope_scaling": None})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    assert parse({"rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}).rope_scaling is None


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.0}}, "unsupported rope type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture 'GemmaForCausalLM'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_rejects(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse(overrides)


def test_family_specifics():
    qwen2 = parse({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 4096})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.sliding_window is None
    qwen2_sliding = parse(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 1,
        }
    )
    assert [qwen2_sliding.layer_sliding_window(i) for i in range(2)] == [None, 64]
    qwen3 = parse({"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "attention_bias": True})
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.attention_bias and qwen3.o_proj_bias
    mistral = parse({"architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.sliding_window == 4096 and mistral.layer_sliding_window(0) == 4096
    assert parse({"architectures": ["MistralForCausalLM"], "sliding_window": None}).sliding_window is None
    llama_bias = parse({"attention_bias": True, "torch_dtype": "bfloat16"})
    assert llama_bias.attention_bias and llama_bias.o_proj_bias and llama_bias.torch_dtype == "bfloat16"


def test_eos_ids_union(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    config = ModelConfig.from_dir(tmp_path)
    assert config.eos_token_ids == [2, 7, 9] and config.bos_token_id == 1
    assert parse({"eos_token_id": [5, 6]}).eos_token_ids == [5, 6]


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_saved_checkpoints_parse(checkpoint):
    name, directory, hf_model = checkpoint
    config = ModelConfig.from_dir(directory)
    hf = hf_model.config
    assert config.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.sliding_window == {"mistral_window": 8, "gemma3": 6, "gemma3_tied": 6, "mixtral": 8}.get(name)
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    assert (config.moe.num_experts if config.moe else None) == experts
    assert list(config.layer_types) == list(getattr(hf, "layer_types", None) or config.layer_types)
    assert (config.rope_scaling or {}).get("rope_type") == {"llama3_rope": "llama3", "gemma3": "linear"}.get(name)
    assert config.local_rope_theta == (10000.0 if name.startswith("gemma3") else None)


GEMMA3 = {**BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 7,
          "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512}  # fmt: skip


def test_gemma3_configs_of_both_generations():
    """transformers v5 writes rope_parameters per layer type; older configs rope_theta,
    rope_local_base_freq and a rope_scaling of the global layers. Without layer_types every
    sliding_window_pattern-th layer is global (default 6)."""
    old = parse(
        {
            **GEMMA3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    new = parse({**GEMMA3, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }})  # fmt: skip
    assert old == new and old.qk_norm and old.hidden_act == "gelu_pytorch_tanh"
    assert old.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert old.layer_rope(0) == (1e4, None) and old.layer_rope(5) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert [old.layer_sliding_window(i) for i in (4, 5)] == [512, None]
    assert parse({**GEMMA3, "sliding_window_pattern": 2}).layer_types[:3] == (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    )
    assert old.hf_config["hidden_activation"] == "gelu_pytorch_tanh"
    assert old.tie_word_embeddings and not parse({**GEMMA3, "tie_word_embeddings": False}).tie_word_embeddings
    llama = parse({})
    assert llama.layer_rope(0) == (10000.0, None) and llama.local_rope_theta is None


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({**GEMMA3, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        (
            {**GEMMA3, "hidden_activation": "gelu"},
            "unsupported hidden_act 'gelu': Gemma3ForCausalLM is implemented with gelu_pytorch_tanh",
        ),
        (
            {"hidden_act": "gelu_pytorch_tanh"},
            "unsupported hidden_act 'gelu_pytorch_tanh': LlamaForCausalLM is implemented with silu",
        ),
        ({**GEMMA3, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**GEMMA3, "sliding_window": None}, "sliding_window is not set"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "supported: .*Gemma3ForCausalLM"),
    ],
)
def test_gemma3_rejects(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse(overrides)
