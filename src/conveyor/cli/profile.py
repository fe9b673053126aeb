"""bin/profile: print a running server's per-process latency profile; optionally dump one trace.

    bin/profile --port 7700                      # p50/p90/p99 per process and stage, last 60 s
    bin/profile --port 7700 --window 10          # the last 10 s only
    bin/profile --port 7700 --trace trace.json   # + one Chrome/Perfetto timeline of all processes

The trace opens in https://ui.perfetto.dev or chrome://tracing: one track per process on the
shared CLOCK_MONOTONIC, each scheduler ``plan_round_trip`` joined to the worker's
``execute`` of the same step by a flow arrow. docs/benchmarks.md says how to read it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from conveyor.cli.server_address import add_server_arguments, client_options, server_address
from conveyor.client import Client, NoServerError, ServerError
from conveyor.profiling import chrome_trace


def format_profile(reply: dict[str, Any]) -> str:
    """The profile reply as one text table per process."""
    lines = [f"profile over the last {reply['window_s']:g} s (clock {reply.get('clock', '?')})"]
    if reply.get("error"):
        lines.append(f"warning: {reply['error']}")
    for proc in reply["processes"]:
        lines.append("")
        state = "" if proc["enabled"] else ", profiling disabled (serve --no-profile)"
        lines.append(f"{proc['process']} (pid {proc['pid']}, up {proc['uptime_s']:.0f} s{state})")
        metrics = proc["metrics"]
        if metrics:
            lines.append(
                f"  {'stage':<22} {'unit':<8} {'count':>7} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}"
            )
            for name, m in metrics.items():
                if m["count"] == 0:
                    lines.append(f"  {name:<22} {m['unit']:<8} {0:>7}")
                    continue
                lines.append(
                    f"  {name:<22} {m['unit']:<8} {m['count']:>7} {_num(m['mean'])} {_num(m['p50'])} "
                    f"{_num(m['p90'])} {_num(m['p99'])} {_num(m['max'])}"
                )
        counters = proc["counters"]
        if counters:
            parts = [f"{name} {c['rate']:.1f}/s (total {c['total']})" for name, c in counters.items()]
            lines.append("  rates: " + ", ".join(parts))
        if proc["values"]:
            lines.append("  " + ", ".join(f"{name} {value:.3f}" for name, value in proc["values"].items()))
    return "\n".join(lines)


def _num(value: float) -> str:
    if value != 0 and (abs(value) < 0.01 or abs(value) >= 1e6):
        return f"{value:>9.2e}"
    return f"{value:>9.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile", description="Print a running Conveyor server's latency profile.")
    p.add_argument("--window", type=float, default=60.0, help="seconds of recent history to summarize")
    p.add_argument("--trace", metavar="PATH", help="write one Chrome/Perfetto JSON trace spanning all processes")
    p.add_argument("--json", metavar="PATH", help="write the raw profile reply as JSON")
    add_server_arguments(p, timeout_s=30.0, timeout_help="seconds to wait for the reply")
    args = p.parse_args(argv)
    options = client_options(p, args)
    address = server_address(args)
    try:
        with Client(address, **options) as client:
            reply = client.profile(args.window, trace=bool(args.trace))
    except (NoServerError, TimeoutError, ServerError, OSError) as exc:
        print(f"profile: {exc}", file=sys.stderr)
        return 1
    print(format_profile(reply))
    if args.trace:
        trace = chrome_trace(reply["processes"])
        with open(args.trace, "w", encoding="utf-8") as f:
            json.dump(trace, f)
        spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
        print(f"\ntrace: {spans} spans from {len(reply['processes'])} processes written to {args.trace}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(reply, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
