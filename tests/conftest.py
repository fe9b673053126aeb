"""Suite-wide setup. Triton kernels run on CPU tensors through Triton's interpreter when no
CUDA device exists; ``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set
here, before any test module can import Triton. torch is optional: the tokenizer-side tests
also run in an environment without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests draw the same examples on every run (a red suite is the code's, never the
# draw's); HYPOTHESIS_PROFILE=explore draws fresh ones, to look for new failures (the fuzz
# test and the tokenizer's properties found real bugs so): a failure found there becomes an
# @example. The no-torch environment has hypothesis too.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    _hypothesis_settings.register_profile("explore", derandomize=False, print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:
    pass


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The real default model's cached checkpoint directory (SmolLM2-135M-Instruct Q4_1 GGUF,
    fetched by the product's own fetch; skipped, with the reason, only where it cannot be)."""
    from conveyor.checkpoints.gguf.default_model import FetchError, default_model_file
    from conveyor.checkpoints.gguf.prepare import prepared_dir

    try:
        source = default_model_file()
    except FetchError as exc:
        pytest.skip(f"the default model cannot be fetched here: {exc}")
    return prepared_dir(source)


@pytest.fixture(scope="session")
def real_hf_model(real_model_dir):
    """transformers' model of the real default model's GGUF file, dequantized to float32: the
    reference of every real-model test, loaded once per session (reading the file's
    metadata and dequantizing it take seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from conveyor.checkpoints.gguf.prepare import gguf_file

    source = gguf_file(real_model_dir)
    return AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def real_hf_logprobs(real_hf_model):
    """``f(sequences)``: transformers' log-softmax at every position of each token-id sequence
    (one right-padded batch: causal attention leaves every real position as it is)."""
    import torch

    def logprobs(sequences: list[list[int]]) -> torch.Tensor:
        width = max(map(len, sequences))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        with torch.no_grad():
            return torch.log_softmax(real_hf_model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)

    return logprobs
