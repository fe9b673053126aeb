"""GGUF checkpoints: :mod:`.reader` (metadata and tensors, torch-free), :mod:`.prepare` (the
cached checkpoint directory a GGUF file is served through) and :mod:`.default_model` (the real
model bin/serve serves by default, fetched once)."""
