"""Kernel tests run everywhere: on a CUDA device when there is one, else on CPU tensors through
Triton's interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a function, which happens for
Triton's own standard library when ``triton.language`` is first imported and for ours when a
``conveyor.kernels`` module is. So it is set here, before any test module of this folder imports
them. If something imported Triton earlier in the same process (another folder's tests collected
first, e.g. ``pytest tests/worker tests/kernels``), interpretation can no longer be switched on
and every kernel test fails with an explanation instead of a confusing traceback; run
``TRITON_INTERPRET=1 python -m pytest ...`` then, or set it in a top-level conftest.
"""

from __future__ import annotations

import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
_TRITON_IMPORTED_TOO_EARLY = False

if not HAS_CUDA and "TRITON_INTERPRET" not in os.environ:
    _TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _interpreter_ready() -> None:
    if _TRITON_IMPORTED_TOO_EARLY:
        pytest.fail(
            "Triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1 "
            "(no CUDA device here); run with TRITON_INTERPRET=1 in the environment",
            pytrace=False,
        )


@pytest.fixture
def device() -> torch.device:
    """Where kernel inputs live: the GPU when present, else the CPU (interpreted kernels)."""
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator per test, so each case's inputs are reproducible alone."""
    return torch.Generator().manual_seed(20240601)
