"""bin/bench experiments' five tables as text (:func:`format_tables`), each with the published
figure beside ours, from the tables :class:`conveyor_tools.bench.experiments.Experiments` computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor_tools.bench.experiments import SYSTEMS, number_text


def format_tables(tables: dict[str, Any], env: dict[str, Any], threads: int | None = None) -> str:
    """The five tables as text, each with the published figure beside ours, under the machine."""
    dev, host = env["device"], env["machine"]
    cpu = f"CPU {host['cpu']}, {host['usable_cpus']} usable cores" + (f", {threads} torch thread(s)" if threads else "")
    machine = cpu if dev["kind"] == "cpu" else f"{dev['name']} ({dev['kind']}); {cpu}"
    versions = env["versions"]
    out = [f"Machine: {machine}; torch {versions['torch']}, conveyor {versions['conveyor']}"]
    if "1_throughput" in tables:
        t = tables["1_throughput"]
        lo, hi = t["published"]["ratio"]
        lines = [
            f"1. Throughput, continuous vs static (output tok/s; published {lo}x to {hi}x on "
            f"{t['published']['setup']})",
            f"{'batch':>6} {'requests':>9} {THROUGHPUT_HEADER}",
        ]
        for r in t["rows"]:
            lines.append(f"{r['batch_size']:>6} {r['num_requests']:>9} {_throughput_cells(r)}" + _na(r["unavailable"]))
        out.append("\n".join(lines))
    if "2_latency" in tables:
        t = tables["2_latency"]
        lo, hi = t["published"]["ratio"]
        rate = "-" if t["rate_req_s"] is None else f"{t['rate_req_s']:.2f}"
        how = "" if t["load"] is None else f" ({t['load']:.0%} of continuous capacity)"
        lines = [
            f"2. End-to-end latency at {rate} req/s{how}, batch {t['batch_size']} "
            f"(static / continuous; published {lo}x to {hi}x lower)" + _na(t["unavailable"]),
            f"{'pct':>5} {'continuous s':>13} {'static s':>9} {'ratio':>7}",
        ]
        for r in t["rows"]:
            lines.append(
                f"{'p' + str(r['percentile']):>5} {number_text(r['continuous_s'], 13, 2)} "
                f"{number_text(r['static_s'], 9, 2)} {number_text(r['ratio'], 6, 2)}x"
            )
        out.append("\n".join(lines))
    if "3_occupancy" in tables:
        t = tables["3_occupancy"]
        p = t["published"]
        lines = [
            f"3. Batch occupancy, batch {t['batch_size']} (mean sequences per step / max_num_seqs; "
            f"published static {p['static']:.0%}, continuous {p['continuous']:.0%})",
            f"{'system':<11} {'per step':>9} {'over time':>10} {'seqs/step':>10}",
        ]
        lines += _system_rows(
            t,
            11,
            lambda o: (
                f"{_pct(o['fraction_per_step'], 9)} {_pct(o['fraction_over_time'], 10)} "
                f"{number_text(o['mean_per_step'], 10, 1)}"
            ),
        )
        out.append("\n".join(lines))
    if "4_kv" in tables:
        t = tables["4_kv"]
        p = t["published"]
        per_token = t["kv_bytes_per_token"]
        lines = [
            f"4. KV cache, batch {t['batch_size']} (blocks of {t['block_size']} tokens, {per_token} bytes of KV "
            "per token; "
            f"published waste: static {p['static_gb']:g} GB, continuous {p['continuous_gb']:g} GB)",
            f"{'system':<15} {'avg blocks':>10} {'peak blocks':>11} {'avg slack tok':>13} {'peak waste':>11} "
            f"{'coverage':>9}",
        ]
        lines += _system_rows(
            t,
            15,
            lambda kv: (
                f"{number_text(kv['avg_held_blocks'], 10, 1)} {number_text(kv['peak_held_blocks'], 11, 0)} "
                f"{number_text(kv['avg_slack_tokens'], 13, 1)} {_bytes(kv['peak_slack_tokens'] * per_token, 11)} "
                f"{_pct(kv['coverage'], 9)}"
            ),
        )
        pad = t["padded_static"]
        lines.append(
            f"{'padded static':<15} {'(computed)':>10} {'':>11} {'':>13} "
            f"{_bytes(pad['peak_waste_tokens'] * per_token, 11)} "
            f"  {pad['fraction']:.0%} of padded slots never hold a token"
        )
        out.append("\n".join(lines))
    if "5_variance" in tables:
        t = tables["5_variance"]
        lines = [
            f"5. Output-length spread at one mean, batch {t['batch_size']} (continuous / static throughput)",
            f"{'spread':<7} {'sigma':>6} {'cv':>5} {THROUGHPUT_HEADER} {'published':>10}",
        ]
        for r in t["rows"]:
            lines.append(
                f"{r['spread']:<7} {r['sigma']:>6.2f} {number_text(r['output_len_cv'], 5, 2)} {_throughput_cells(r)} "
                f"{r['published']:>9.1f}x" + _na(r["unavailable"])
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


#: The columns tables 1 and 5 end on (before 5's published figure): continuous and static
#: output tok/s and their ratio, :func:`_throughput_cells` of a row.
THROUGHPUT_HEADER = f"{'continuous':>11} {'static':>9} {'ratio':>7}"


def _throughput_cells(row: dict[str, Any]) -> str:
    return (
        f"{number_text(row['continuous_tok_s'], 11, 1)} {number_text(row['static_tok_s'], 9, 1)} "
        f"{number_text(row['ratio'], 6, 2)}x"
    )


def _system_rows(table: dict[str, Any], width: int, row: Callable[[dict[str, Any]], str]) -> list[str]:
    """One line per system: its name, then ``row`` of its entry, or n/a and why it did not run."""
    return [
        f"{s:<{width}} {row(table[s])}" if table[s].get("available") else f"{s:<{width}} n/a: {table[s].get('reason')}"
        for s in SYSTEMS
    ]


def _pct(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.0%}"


def _bytes(value: float, width: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:>{width - 4}.2f} {unit}"
    return f"{value:>{width - 2}.0f} B"


def _na(reason: str | None) -> str:
    return f"  n/a: {reason}" if reason else ""
