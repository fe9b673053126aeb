#!/usr/bin/env python3
"""Encode + decode cost of the internal messages: the codec in use against another one, side
by side (a script, not a test).

For each message the scheduler, worker and frontend exchange per step (a decode-step
StepPlan naming N running requests, its StepResult, the iteration's TokenOutputs) and for
the frontend's AddRequest (a prompt of N tokens), it times ``encode`` then ``decode`` of
the same message, reading the decoded arrays out as Python ints as the receivers do.
Messages are built as their senders build them (lists for most columns). Variants:

- ``codec``: :mod:`conveyor.ipc.codec` over :mod:`conveyor.ipc.messages`, the ones in use;
- ``baseline``: another codec module with the same interface, loaded from ``--baseline
  FILE`` together with the messages module it was written for (``--baseline-messages
  FILE``; default: the one in use), e.g. both files from git history.

    python bench/codec.py                                   # N = 1, 64, 256 and a 2,000-token prompt
    python bench/codec.py --baseline old_codec.py --baseline-messages old_messages.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
from harness import per_call_us  # bench/ is this script's directory

from conveyor.ipc import codec
from conveyor.ipc import messages as current_messages


def messages(m: types.ModuleType, n: int) -> dict[str, Any]:
    """The messages of one decode step with ``n`` running requests, built from the classes
    of messages module ``m`` as their senders build them (the scheduler's plan columns are
    int32 arrays, its drops a list; the worker's slots a list, its sampled ids a numpy
    array; the frontend's prompt a list)."""
    rows = list(range(0, n, 16))  # one request in 16 crosses a block boundary this step
    cached = m.CachedRequests(
        np.arange(n, dtype=np.int32),
        np.arange(100, 100 + n, dtype=np.int32),
        np.ones(n, np.int32),
        rows,
        [[1000 + r] for r in rows],
    )
    return {
        "StepPlan": m.StepPlan(7, [], cached, [n] if n > 1 else []),
        "StepResult": m.StepResult(7, list(range(n)), np.full(n, 11, dtype=np.int32), None, 0.001),
        "TokenOutputs": m.TokenOutputs(
            [m.RequestOutput("first", [5], None, None, 1.0, 2.0, 0)], [f"req-{i}" for i in range(n)], [11] * n
        ),
        "AddRequest": m.AddRequest("req-1", list(range(1000, 1000 + n)), m.SamplingParams(max_tokens=64), 1.0, 0),
    }


# The Int32Array fields each receiver reads out as Python ints (the model runner, the
# scheduler): the same reads for every variant.
ARRAY_FIELDS = {
    "StepPlan": [
        ("cached_requests", "slots"),
        ("cached_requests", "num_computed_tokens"),
        ("cached_requests", "num_scheduled_tokens"),
        ("finished_slots",),
    ],
    "StepResult": [("slots",), ("sampled_token_ids",)],
    "TokenOutputs": [],
    "AddRequest": [("prompt_token_ids",)],
}


def read_out(msg: Any) -> None:
    for path in ARRAY_FIELDS[type(msg).__name__]:
        value = msg
        for name in path:
            value = getattr(value, name)
        value.tolist()


# ------------------------------------------------------------------------- timing


def time_us(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of one call over ``iters`` calls, in us."""
    return statistics.median(per_call_us(fn, iters, repeats, warmup_calls=1))


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up while being built)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _as_messages(module: types.ModuleType) -> Iterator[None]:
    """While loading a codec: ``conveyor.ipc.messages`` is ``module``."""
    saved = sys.modules["conveyor.ipc.messages"]
    sys.modules["conveyor.ipc.messages"] = module
    try:
        yield
    finally:
        sys.modules["conveyor.ipc.messages"] = saved


def load_baseline(codec_path: str, messages_path: str | None) -> tuple[types.ModuleType, types.ModuleType]:
    """(codec, messages) of the baseline: the codec module imports the messages module."""
    m = _load("baseline_messages", messages_path) if messages_path else current_messages
    with _as_messages(m):
        return _load("baseline_codec", codec_path), m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt", type=int, default=2000, help="AddRequest prompt length measured besides --sizes")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline", help="another codec module (same interface) to time side by side")
    p.add_argument("--baseline-messages", help="the messages module the --baseline codec was written for")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args()

    variants = {"codec": (codec, current_messages)}
    if args.baseline:
        variants["baseline"] = load_baseline(args.baseline, args.baseline_messages)
    rows = []
    print(f"{'message':<13} {'N':>5} " + " ".join(f"{v:>12}" for v in variants))
    for k, n in enumerate([*args.sizes, args.prompt]):
        names = ["AddRequest"] if k == len(args.sizes) else list(ARRAY_FIELDS)
        for name in names:
            row: dict[str, Any] = {"message": name, "n": n}
            for label, (module, m) in variants.items():
                msg = messages(m, n)[name]
                row[label] = time_us(lambda: read_out(module.decode(module.encode(msg))), args.iters, args.repeats)
            rows.append(row)
            print(f"{name:<13} {n:>5} " + " ".join(f"{row[v]:>9.2f} us" for v in variants))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "unit": "us per encode + decode + reading the arrays",
                    "baseline": args.baseline,
                    "baseline_messages": args.baseline_messages,
                    "python": sys.version.split()[0],
                    "msgspec": msgspec.__version__,
                    "platform": platform.platform(),
                    "processor": platform.processor(),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
