"""Fixtures that run bin/serve as a user would: a real subprocess tree on a real checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.serve_harness import ServeProcess


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers, with the demo tokenizer beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conveyor.checkpoints.demo import checkpoint as demo

    path = tmp_path_factory.mktemp("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.TOKENIZER_DIR / name, path / name)
    from conveyor.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


@pytest.fixture
def serve_factory(tmp_path):
    """Start bin/serve with given flags; every server started is torn down and checked for orphans."""
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        server = ServeProcess(list(args), tmp_path)
        started.append(server)
        return server

    yield start
    for server in started:
        server.shut_down(list(server.pids.values()))


@pytest.fixture(scope="session")
def hf_greedy(tiny_checkpoint):
    """Greedy continuation by HF transformers, one prompt at a time (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()

    def run(prompt_ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids])
            # An explicit mask: BOS is id 0 here, and generate() would take it for padding.
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(prompt_ids):].tolist()

    return run
