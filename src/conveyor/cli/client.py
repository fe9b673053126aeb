"""bin/client: stream a completion for a prompt from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from conveyor.cli.server_address import add_server_arguments, client_options, server_address
from conveyor.client import Client, ServerError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="client", description="Stream a completion from a running Conveyor server.")
    p.add_argument("prompt", nargs="?", help="prompt text (default: read from stdin)")
    add_server_arguments(p, timeout_s=300.0, timeout_help="seconds to wait for each reply")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-stream", action="store_true", help="wait for the whole completion")
    p.add_argument("--json", action="store_true", help="print the final result as JSON")
    args = p.parse_args(argv)
    options = client_options(p, args)
    fields = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos or None,
    )
    try:
        prompt = args.prompt if args.prompt is not None else sys.stdin.read()
        inputs = {"messages": [{"role": "user", "content": prompt}]} if args.chat else {"prompt": prompt}
        address = server_address(args)
        with Client(address, **options) as client:
            if args.no_stream:
                result = client.generate(**inputs, **fields)
            else:
                result = None
                for delta in client.stream(**inputs, **fields):
                    if not args.json:
                        sys.stdout.write(delta.text)
                        sys.stdout.flush()
                    result = delta.result or result
    except (ConnectionError, TimeoutError, ServerError, ValueError) as exc:  # no server, lost, refused; too large
        print(f"client: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C (reading stdin, or waiting): leaving the client aborts its request
        print("\nclient: interrupted", file=sys.stderr)
        return 130
    if args.json:
        # asdict, not vars: the result nests dataclasses (usage, choices) json cannot write.
        print(json.dumps(dataclasses.asdict(result)))
    elif args.no_stream:
        print(result.text)
    else:
        print()
    if result.finish_reason == "error":
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    print(
        f"[{result.finish_reason}; {result.usage.prompt_tokens} prompt + {result.usage.completion_tokens} "
        "completion tokens]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
