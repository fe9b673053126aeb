"""Suite-wide setup. Triton kernels run on CPU tensors through Triton's interpreter when no
CUDA device exists; ``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set
here, before any test module can import Triton. torch is optional: the tokenizer-side tests
also run in an environment without it."""

from __future__ import annotations

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
