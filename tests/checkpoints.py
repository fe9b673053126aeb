"""Tiny random checkpoints, saved the way transformers saves real ones, for every test package.

One builder (:func:`build`) draws every parameter again after transformers' init: matrices at
std 0.15, norm weights around 1, biases nonzero. Stock initialisation (std 0.02, zero
biases, unit norms) gives a model whose greedy token hardly depends on anything but the
last input token: attention is nearly uniform, so positions, the order of the cached keys
and values, and a weight loaded into the wrong place all leave its greedy tokens unchanged,
and a test comparing them with transformers' cannot fail on such bugs. At std 0.15 attention
is sharp enough that shuffled positions or two swapped KV blocks change the greedy
continuation (tests/test_checkpoints.py proves it for the serving checkpoint).

- :func:`make_checkpoint` builds the worker tests' families (:data:`CHECKPOINTS`, a small
  vocabulary of token ids only).
- :func:`serving_checkpoint` builds the one Llama every serving-level test runs (bin/serve,
  the engine, HTTP, reliability, soak, tensor parallel, bin/bench): the demo tokenizer beside
  it, so text prompts work.
- :func:`gemma3_serving_checkpoint` builds a Gemma 3 of the serving checkpoint's vocabulary,
  with the demo tokenizer: the engine's Gemma 3 tests.
- :func:`moe_serving_checkpoint` builds a Qwen3-MoE or Mixtral (:data:`QWEN3_MOE`,
  :data:`MIXTRAL`) of the serving checkpoint's vocabulary, with the demo tokenizer: the
  engine's mixture-of-experts tests and bin/bench's MoE row.
- :func:`draft_checkpoint` builds a smaller Llama of the serving checkpoint's vocabulary (a
  speculative-decoding draft that disagrees with it).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

MATRIX_STD = 0.15

#: The sizes every checkpoint here starts from: 2 layers of 4 query heads over 2 KV heads at
#: width 64 (the families' own; the serving checkpoint widens the MLP and the positions).
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=128,
)

#: Gemma 3: local layers of window 6 around a global one (the tests' prompts cross the window),
#: each kind with its own rope (the global one linearly scaled), a query scalar that is not
#: head_dim, capped final logits, untied: every Gemma 3 difference changes the outputs.
GEMMA3: dict[str, Any] = {
    "num_hidden_layers": 3,
    "head_dim": 16,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 4.0,
    "tie_word_embeddings": False,
}

#: Qwen3-MoE: 8 experts of width 32, 2 per token, weights not renormalized (its config's
#: default), the middle of 3 layers dense (``mlp_only_layers``).
QWEN3_MOE: dict[str, Any] = {
    "num_hidden_layers": 3, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "norm_topk_prob": False, "mlp_only_layers": [1],
}  # fmt: skip
#: Mixtral: 8 experts of width 48, 2 per token (renormalized, as Mixtral always is), window 8.
MIXTRAL: dict[str, Any] = {
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 48,
    "sliding_window": 8,
}

# name -> (config class, architecture, overrides of SMALL); a family's seed is its index here.
CHECKPOINTS: dict[str, tuple[type, str, dict[str, Any]]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM", {}),
    "llama3_rope": (
        LlamaConfig,
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama_mha_bias": (LlamaConfig, "LlamaForCausalLM", {"num_key_value_heads": 4, "attention_bias": True}),
    "mistral_window": (MistralConfig, "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2_tied": (Qwen2Config, "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", {"head_dim": 32, "num_key_value_heads": 1}),
    "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM", GEMMA3),
    # Tied embeddings, uncapped logits, the sliding layers' rope base from the default.
    "gemma3_tied": (
        Gemma3TextConfig,
        "Gemma3ForCausalLM",
        {
            **GEMMA3,
            "tie_word_embeddings": True,
            "final_logit_softcapping": None,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500.0}},
        },
    ),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", QWEN3_MOE),
    "mixtral": (MixtralConfig, "MixtralForCausalLM", MIXTRAL),
}

# The serving checkpoint's seed for :func:`randomize` (the families take their index in CHECKPOINTS).
SERVING_SEED = 100


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: norms ``1 + 0.1 N(0, 1)``, everything else ``MATRIX_STD N(0, 1)``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else MATRIX_STD * noise)


def build(config: Any, directory: Path, seed: int) -> torch.nn.Module:
    """Save a model of ``config`` with :func:`randomize`'d float32 weights into ``directory``;
    return it in eval mode with EOS disabled (a reference must not stop early)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(directory)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def make_checkpoint(name: str, directory: Path) -> torch.nn.Module:
    """Save family ``name`` of :data:`CHECKPOINTS` into ``directory``; return the HF model."""
    config_class, architecture, overrides = CHECKPOINTS[name]
    config = config_class(**{**SMALL, **overrides, "architectures": [architecture]}, attn_implementation="eager")
    return build(config, directory, seed=list(CHECKPOINTS).index(name))


def draft_checkpoint(directory: Path, serving: Path, **overrides: Any) -> Path:
    """Save a draft model for the serving checkpoint in ``serving`` into ``directory``: its
    config and so its vocabulary, but one layer, 2 query heads and 1 KV head of 16 (a cache of
    another shape), tied embeddings and other weights; ``overrides`` change more of the config."""
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    config = LlamaConfig.from_pretrained(serving, **{**sizes, **overrides})
    build(config, directory, SERVING_SEED + 1)
    return directory


def _demo_tokenizer(directory: Path) -> Any:
    """Copy the demo tokenizer into ``directory``; return it."""
    from conveyor.checkpoints.demo import checkpoint as demo
    from conveyor.frontend.tokenizer import Tokenizer

    for name in demo.TOKENIZER_FILES:
        shutil.copy(demo.TOKENIZER_DIR / name, directory / name)
    return Tokenizer.from_dir(directory)


def gemma3_serving_checkpoint(directory: Path) -> Path:
    """Save :data:`GEMMA3` (window 6) with the demo tokenizer into ``directory``: 256 positions."""
    tok = _demo_tokenizer(directory)
    sizes = {**SMALL, **GEMMA3, "max_position_embeddings": 256, "vocab_size": tok.vocab_size}
    config = Gemma3TextConfig(
        **sizes, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
        architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip
    build(config, directory, SERVING_SEED + 2)
    return directory


def moe_serving_checkpoint(directory: Path, name: str = "qwen3_moe", **changes: Any) -> Path:
    """Save family ``name`` (``qwen3_moe`` or ``mixtral`` of :data:`CHECKPOINTS`) with the demo
    tokenizer into ``directory``: 256 positions, untied embeddings; ``changes`` override more
    of the config."""
    tok = _demo_tokenizer(directory)
    config_class, architecture, overrides = CHECKPOINTS[name]
    config = config_class(
        **{**SMALL, **overrides, **changes, "max_position_embeddings": 256, "vocab_size": tok.vocab_size},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0, tie_word_embeddings=False,
        architectures=[architecture],
    )  # fmt: skip
    build(config, directory, SERVING_SEED + 3)
    return directory


def serving_checkpoint(directory: Path) -> Path:
    """Save the serving tests' Llama, with the demo tokenizer, into ``directory``: 2 layers,
    4 query and 2 KV heads of 16, 256 positions, untied embeddings."""
    tok = _demo_tokenizer(directory)
    config = LlamaConfig(
        **{**SMALL, "intermediate_size": 128, "max_position_embeddings": 256, "vocab_size": tok.vocab_size},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    build(config, directory, SERVING_SEED)
    return directory


#: A Qwen3-style chat template over the demo tokenizer's headers: tools listed in a system turn,
#: Hermes ``<tool_call>`` calls and ``<tool_response>`` results, earlier answers' reasoning
#: dropped, and ``enable_thinking=false`` rendering an empty think block after the generation
#: prompt, as Qwen3's own template does.
THINKING_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n# Tools\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'assistant' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{{ content }}"
    '{%- for call in message.tool_calls or [] %}<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson "
    "}}}\n</tool_call>"
    "{%- endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\n{{ content "
    "}}\n</tool_response><|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
THINKING_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def qwen3_thinking_checkpoint(directory: Path) -> Path:
    """Save a tiny random Qwen3 whose chat template has a think block (:data:`THINKING_TEMPLATE`)
    into ``directory``: the demo tokenizer with ``<think>``, ``</think>``, ``<tool_call>`` and
    ``</tool_call>`` added as single, non-special tokens (Qwen3's are), 256 positions."""
    import json

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    _demo_tokenizer(directory)
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINKING_TOKENS])
    backend.save(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = THINKING_TEMPLATE
    for token in THINKING_TOKENS:
        tok_config["added_tokens_decoder"][str(backend.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": False,
        }
    config_path.write_text(json.dumps(tok_config, indent=2))
    config = Qwen3Config(
        **{**SMALL, **CHECKPOINTS["qwen3"][2], "max_position_embeddings": 256, "vocab_size": backend.get_vocab_size()},
        bos_token_id=0,
        eos_token_id=4,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    build(config, directory, SERVING_SEED + 3)
    return directory
