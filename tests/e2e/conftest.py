"""Fixtures that run bin/serve as a user would: a real subprocess tree on a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.serve_harness import ServeProcess


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The serving tests' tiny random Llama (tests/checkpoints.py: position-sensitive), with
    the demo tokenizer beside it."""
    from tests.checkpoints import serving_checkpoint

    return serving_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


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
    """Greedy continuation by HF transformers, one prompt at a time (the reference).

    EOS neither stops nor is suppressed (as with ``ignore_eos``). Greedy continuations of a
    prompt are prefixes of each other, so the longest one computed per prompt is kept and cut."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    longest: dict[tuple[int, ...], list[int]] = {}

    def run(prompt_ids: list[int], n: int) -> list[int]:
        key = tuple(prompt_ids)
        if len(longest.get(key, ())) < n:
            with torch.inference_mode():
                ids = torch.tensor([prompt_ids])
                # An explicit mask: BOS is id 0 here, and generate() would take it for padding.
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
                )
            longest[key] = out[0, len(prompt_ids):].tolist()
        return longest[key][:n]

    return run
