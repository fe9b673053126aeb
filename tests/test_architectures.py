"""An architecture no model implements is refused where bin/serve and the engine start, before
any process starts or any weight loads, with one error naming it and the supported ones; the
registry's table is torch-free, so that check needs no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conveyor.checkpoints.architectures import MODEL_CLASSES, SUPPORTED_ARCHITECTURES
from conveyor.cli import serve

CONFIG = {
    "architectures": ["GPT2LMHeadModel"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16,
}  # fmt: skip


def test_serve_refuses_an_unknown_architecture_before_any_process_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = serve.build_parser().parse_args(["--model", str(tmp_path)])
    with pytest.raises(ValueError) as refused:
        serve.server_config(args, str(tmp_path / "run"))
    message = str(refused.value)
    assert "unsupported architecture 'GPT2LMHeadModel'" in message and "\n" not in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


def test_the_table_is_torch_free_and_names_the_four_families_gemma3_and_the_moes():
    code = "import sys, conveyor.checkpoints.architectures; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert set(MODEL_CLASSES) == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
        "Qwen3MoeForCausalLM", "MixtralForCausalLM",
    }  # fmt: skip
