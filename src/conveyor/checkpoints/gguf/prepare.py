"""A GGUF file made into the checkpoint directory every Conveyor process already reads.

:func:`prepared_dir` writes, once per file, a cache directory holding ``config.json`` and
``generation_config.json`` (from the file's metadata, :mod:`.reader`), the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``: the file's own, or
its family's turn format where it carries none) and ``gguf.json``,
which points at the GGUF file itself. The weights stay in the GGUF file: the worker's loader
finds ``gguf.json`` and reads them from there (:func:`gguf_file`), dequantizing at load. So the
frontend's tokenizer and Jinja path, the scheduler's config reading, bin/bench and the
engine all see a plain checkpoint directory and have no GGUF case of their own.

The tokenizer is converted by transformers (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``, then ``save_pretrained``): a well-kept converter of GGUF's token lists,
merges and chat template, run once per file and cached, so serving never imports it again.
transformers is the ``convert`` extra; without it the first start says how to install it.

The cache entry is named by a hash of the file's resolved path, size and modification time
(and this format's version), so an edited or replaced file is converted again, never served
stale; nothing is hashed over the file's bytes, which would cost seconds per start on a large
model.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from conveyor.checkpoints.demo.checkpoint import cached_checkpoint_dir
from conveyor.checkpoints.gguf.families import family_of_model_type
from conveyor.checkpoints.gguf.reader import GGUFError, check_tensors, hf_config, open_gguf
from conveyor.checkpoints.model_config import ModelConfig

POINTER = "gguf.json"
# Bump when what a prepared directory holds changes.
FORMAT_VERSION = 1
CONVERT_HINT = "pip install 'conveyor[convert]'"


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``*.gguf`` of a directory
    without ``config.json``; None when ``path`` is neither (GGUFError for a directory holding
    several)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(files) > 1:
            names = ", ".join(p.name for p in files)
            raise GGUFError(f"{path} holds {len(files)} GGUF files ({names}): name one of them")
        return files[0] if files else None
    return None


def prepared_dir(gguf: str | Path) -> Path:
    """The checkpoint directory of GGUF file ``gguf`` (module docstring), written on first use.

    Checks the whole file first (metadata, every tensor's name and type: GGUFError), then
    converts the tokenizer (ImportError naming the extra when transformers is missing).
    """
    source = Path(gguf).expanduser().resolve()
    try:
        stat = source.stat()
    except OSError as exc:
        raise GGUFError(f"{gguf}: cannot read it ({exc.strerror or exc})") from None
    identity = {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": FORMAT_VERSION}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    name = f"gguf-{source.stem}-{key}"
    return cached_checkpoint_dir(name, lambda out: _write(source, identity, out))


def gguf_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a prepared directory's weights live in (None for a plain HF checkpoint)."""
    pointer = Path(model_dir) / POINTER
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text(encoding="utf-8"))["path"])


def _write(source: Path, identity: dict[str, Any], out: Path) -> None:
    reader = open_gguf(source)
    config, generation = hf_config(reader, source)
    try:
        ModelConfig.from_dicts(config, generation)
    except ValueError as exc:
        raise GGUFError(f"{source}: {exc}") from None
    check_tensors(reader, config, source)
    if reader.fields.get("tokenizer.ggml.tokens") is None:
        raise GGUFError(f"{source}: metadata field tokenizer.ggml.tokens is missing (the file carries no tokenizer)")
    _convert_tokenizer(source, out, family_of_model_type(config["model_type"]).chat_template)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    _write_json(out / POINTER, identity)  # last: a directory without it is never renamed into place


def _convert_tokenizer(source: Path, out: Path, default_template: str | None) -> None:
    try:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(
            f"{source}: converting a GGUF file's tokenizer (once, then cached) needs transformers: {CONVERT_HINT}"
        ) from None
    print(f"conveyor: converting the tokenizer of {source.name} once (transformers) ...", file=sys.stderr, flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:  # transformers raises many kinds for a tokenizer it cannot convert
        raise GGUFError(f"{source}: transformers cannot convert its tokenizer ({type(exc).__name__}: {exc})") from None
    if not tokenizer.chat_template and default_template:  # the file carries none: its family's turn format
        tokenizer.chat_template = default_template
    tokenizer.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise GGUFError(f"{source}: transformers wrote no tokenizer.json for its tokenizer")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
