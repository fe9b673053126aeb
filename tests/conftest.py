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
