"""bin/convert-tokenizer: write tokenizer.json for a checkpoint that ships only a slow tokenizer.

The frontend reads tokenizer.json with the `tokenizers` library (transformers would import
torch into the tokenizer process). transformers can convert sentencepiece and other slow
tokenizers to that format once, offline; this tool does that and nothing else. transformers
is an extra (``pip install "conveyor[convert]"``): nothing that serves needs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="convert-tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("model_dir", help="local HF checkpoint directory")
    p.add_argument("--force", action="store_true", help="overwrite an existing tokenizer.json")
    args = p.parse_args(argv)
    target = Path(args.model_dir) / "tokenizer.json"
    if target.exists() and not args.force:
        print(f"{target} already exists (use --force to overwrite)", file=sys.stderr)
        return 1
    try:
        from transformers import AutoTokenizer
    except ImportError:
        print('convert-tokenizer needs transformers: pip install "conveyor[convert]"', file=sys.stderr)
        return 1

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        print(f"transformers could not build a fast tokenizer for {args.model_dir}", file=sys.stderr)
        return 1
    backend.save(str(target))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
