"""bin/eval: the project's 100-item task set (:mod:`conveyor_tools.eval.tasks`) through a Conveyor
server, greedy, with the accuracy by category and every item's reply in a JSON file; with
``--hf``, transformers on the same checkpoint too, item by item.

Why: a real model's answers must not change by being served. ``--hf`` compares each item's
tokens and correctness with transformers' greedy reply and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from conveyor_tools.eval.runs import accuracy, hf_replies, served_replies
from conveyor_tools.eval.tasks import tasks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", help="what bin/serve serves (a checkpoint directory, a .gguf file, demo); default: its default model"
    )
    p.add_argument("--address", help="a running server's address instead of starting one (--hf then needs --model)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--limit", type=int, help="only the first N items of each category")
    p.add_argument(
        "--hf", action="store_true", help="also run transformers on the same checkpoint and compare item by item"
    )
    p.add_argument("--threads", type=int, default=1, help="the server's --threads and transformers' torch threads")
    p.add_argument("--json", help="write every item's question, reply and verdict here")
    p.add_argument("--serve-arg", action="append", default=[], help="one more bin/serve flag (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from conveyor.runtime.model_source import StartupError, resolve_model

    items = tasks()
    if args.limit:
        items = [item for item in items if int(item.id.rsplit("-", 1)[1]) < args.limit]
    if args.address and args.hf and not args.model:
        print("eval: --hf with --address needs --model (the checkpoint the server serves)", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model)[0] if (args.model or not args.address) else None
    except StartupError as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    if args.address:
        replies = served_replies(args.address, items, args.max_tokens)
    else:
        from conveyor_tools.bench.server import BenchServer

        serve = ["--model", model_dir, "--threads", str(args.threads), *args.serve_arg]
        with BenchServer(serve) as server:
            replies = served_replies(server.address, items, args.max_tokens)
    correct = [item.correct(r.text) for item, r in zip(items, replies)]
    report = {"model": args.model or "default", "max_tokens": args.max_tokens, "accuracy": accuracy(items, correct)}
    rows = [
        {"id": i.id, "category": i.category, "question": i.question, "answer": i.answer, "reply": r.text, "correct": ok}
        for i, r, ok in zip(items, replies, correct)
    ]
    differ = 0
    if args.hf:
        reference = hf_replies(model_dir, items, args.max_tokens, args.threads)
        hf_correct = [item.correct(r.text) for item, r in zip(items, reference)]
        report["hf_accuracy"] = accuracy(items, hf_correct)
        for row, ours, theirs, ok in zip(rows, replies, reference, hf_correct):
            row.update(hf_reply=theirs.text, hf_correct=ok, tokens_equal=ours.token_ids == theirs.token_ids)
            differ += row["correct"] != ok or not row["tokens_equal"]
        report["items_differing_from_hf"] = differ
    report["items"] = rows
    for category, (right, total) in report["accuracy"].items():
        line = f"{category:12s} {right:3d}/{total:<3d} ({100 * right / total:5.1f}%)"
        if args.hf:
            hf_right, _ = report["hf_accuracy"][category]
            line += f"   transformers {hf_right:3d}/{total:<3d}"
        print(line)
    if args.hf:
        print(f"items whose tokens or verdict differ from transformers': {differ}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
