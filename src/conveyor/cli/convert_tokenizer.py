"""bin/convert-tokenizer: write tokenizer.json for a checkpoint that ships only a slow tokenizer.

The frontend reads tokenizer.json with the `tokenizers` library (transformers would import
torch into the tokenizer process). transformers can convert sentencepiece and other slow
tokenizers to that format once, offline; this tool does that and nothing else. transformers
is an extra (``pip install "conveyor[convert]"``): nothing that serves needs it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
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

    # From the slow files alone: transformers would read the tokenizer.json being replaced
    # (--force), and a broken one is a reason to convert again. The checkpoint's other files
    # are linked, not copied, into a folder without it.
    with tempfile.TemporaryDirectory() as slow_only:
        for path in Path(args.model_dir).iterdir():
            if path.name != "tokenizer.json":
                (Path(slow_only) / path.name).symlink_to(path.resolve())
        try:
            tokenizer = AutoTokenizer.from_pretrained(slow_only)
        except (ImportError, OSError, ValueError) as exc:  # no sentencepiece/protobuf; no tokenizer files
            print(
                f"convert-tokenizer: transformers could not load the tokenizer of {args.model_dir}: "
                f"{' '.join(str(exc).split())}",
                file=sys.stderr,
            )
            return 1
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        print(f"transformers could not build a fast tokenizer for {args.model_dir}", file=sys.stderr)
        return 1
    backend.save(str(target))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
