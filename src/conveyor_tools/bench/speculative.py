"""bin/bench speculative: speculative decoding against plain decoding, side by side in one run.

Every (batch size, method) pair gets a fresh ``bin/serve`` on the copy checkpoint
(:mod:`conveyor_tools.bench.copy_model`), which serves each workload of the run in turn
(``copy``: full acceptance; ``mispredict``: proposals every step, nearly all rejected). The
methods alternate within each batch size and the whole sweep repeats ``--repeat`` times, so a
noisy machine's drift falls on both sides alike; the median of each cell is reported.

Methods (:data:`METHODS`: a name and its bin/serve flags; a new proposer is one more entry):
``off``; ``ngram`` (prompt lookup, with the batch-size rule at its default); and
``ngram-nolimit`` (``--speculative-max-batch 0``: the rule lifted), run only at batch sizes
above the rule's default, where it shows what the rule avoids; and, when asked for,
``off-nooverlap`` (``--no-overlap``: no speculation, every plan formed in sync as
speculation forms them), which separates the cost of losing overlap from that of verifying;
``draft-self`` and ``draft-random``, the draft-model proposer with the copy checkpoint as its
own draft (acceptance ~100 %) and with the demo model, same vocabulary, random weights (~0 %).

Per cell, from the run and the scheduler's counters over the measured window
(:func:`conveyor_tools.bench.drivers.counter_deltas`): output tok/s, target forwards (steps),
output tokens per forward, the server's CPU milliseconds per step (worker, scheduler and
frontend together, read from /proc around the run), the acceptance rate, mean acceptance
length and proposals per verifying step (:func:`conveyor.ipc.messages.speculation_rates`),
and against ``off`` at the same batch size and workload: the tok/s speedup, the tokens per
forward ratio, the CPU-per-step ratio (the per-step overhead of proposing and verifying)
and the output tokens per CPU second ratio. The CPU figures are there because a shared
machine's wall clock swings by several times between runs; CPU time mostly does not. (They
are not the same measure: with speculation on the scheduler never plans ahead, so its time
is on the critical path, where with it off it overlaps the worker's.)
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir
from conveyor.ipc.messages import speculation_rates
from conveyor.runtime.config import SchedulerConfig
from conveyor_tools.bench.copy_model import COPY_WORKLOADS, copy_checkpoint_dir, copy_workload
from conveyor_tools.bench.cpu import LOAD_GENERATOR
from conveyor_tools.bench.drivers import run_offline
from conveyor_tools.bench.server import BenchServer
from conveyor_tools.bench.workloads import Workload

OFF = "off"
METHODS: dict[str, list[str]] = {
    OFF: [],
    "ngram": ["--speculative-method", "ngram"],
    "ngram-nolimit": ["--speculative-method", "ngram", "--speculative-max-batch", "0"],
    # No speculation, plans formed in sync as speculation forms them: what losing overlap costs.
    "off-nooverlap": ["--no-overlap"],
    # The draft-model proposer: the served copy checkpoint as its own draft (every proposal
    # accepted), and the demo model as the draft (the copy model's architecture and vocabulary,
    # random weights: nearly every proposal rejected). DRAFT_SELF / DRAFT_RANDOM are resolved
    # to checkpoint directories by method_flags.
    "draft-self": ["--speculative-method", "draft", "--speculative-model", "DRAFT_SELF"],
    "draft-random": ["--speculative-method", "draft", "--speculative-model", "DRAFT_RANDOM"],
}
NOLIMIT_ABOVE = SchedulerConfig.speculative_max_batch  # ngram-nolimit only differs above the rule
COLUMNS = (
    "batch", "workload", "method", "out tok/s", "speedup", "forwards", "tok/forward", "x tok/fwd",
    "cpu ms/step", "x step", "x tok/cpu-s", "accept", "mean len", "props/step",
)  # fmt: skip


@dataclass(frozen=True)
class SpecSettings:
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    workloads: tuple[str, ...] = COPY_WORKLOADS
    methods: tuple[str, ...] = (OFF, "ngram", "ngram-nolimit")
    num_speculative_tokens: int = 4
    batches_per_run: int = 3  # requests per run = this x the batch size
    output_len: int = 96
    repeat: int = 1
    seed: int = 0


def methods_at(settings: SpecSettings, batch: int) -> list[str]:
    """The methods run at ``batch``: all asked for, but ``ngram-nolimit`` only above the rule."""
    return [m for m in settings.methods if m != "ngram-nolimit" or batch > NOLIMIT_ABOVE]


def method_flags(method: str, k: int) -> list[str]:
    drafts = {"DRAFT_SELF": lambda: str(copy_checkpoint_dir()), "DRAFT_RANDOM": lambda: str(demo_checkpoint_dir())}
    flags = [drafts[flag]() if flag in drafts else flag for flag in METHODS[method]]
    return flags + ["--num-speculative-tokens", str(k)] if "--speculative-method" in flags else flags


def cell(run_summary: dict[str, Any], counters: dict[str, Any], cpu_s: dict[str, float]) -> dict[str, Any]:
    """One run's figures (module docstring), before the ratios against ``off``; ``cpu_s``:
    CPU seconds of each server process over the run."""
    steps, tokens, cpu = counters["num_steps"], run_summary["output_tokens"], sum(cpu_s.values())
    out = {
        "output_tok_s": run_summary["output_tok_s"],
        "wall_s": run_summary["wall_s"],
        "output_tokens": tokens,
        "forwards": steps,
        "tokens_per_forward": tokens / steps if steps else None,
        "ms_per_step": 1e3 * run_summary["wall_s"] / steps if steps else None,
        "cpu_ms_per_step": 1e3 * cpu / steps if steps else None,
        "output_tok_cpu_s": tokens / cpu if cpu else None,
        "cpu_s": cpu_s,
        "counters": counters,
    }
    out.update(speculation_rates(counters))
    return out


def run_sweep(
    settings: SpecSettings,
    serve_args: Callable[[int, list[str]], list[str]],
    vocab_size: int,
    progress: Callable[[int, str], Any],
    timeout: float,
) -> list[dict[str, Any]]:
    """Every cell of the sweep, each with its runs and the median figures; ``serve_args(batch,
    method flags)`` is bin/serve's command line for one server."""
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for rep in range(settings.repeat):
        for batch in settings.batch_sizes:
            workloads = {
                name: copy_workload(
                    name, batch * settings.batches_per_run, vocab_size, settings.output_len, settings.seed
                )
                for name in settings.workloads
            }
            methods = methods_at(settings, batch)
            for method in methods if rep % 2 == 0 else methods[::-1]:  # each order as often
                flags = method_flags(method, settings.num_speculative_tokens)
                with BenchServer(serve_args(batch, flags)) as server:
                    for name, workload in workloads.items():
                        runs.setdefault((batch, name, method), []).append(
                            _one(server, workload, f"b{batch} {name} {method}", progress, timeout)
                        )
    return with_ratios([median_cell(key, cells) for key, cells in runs.items()])


def _one(
    server: BenchServer, workload: Workload, label: str, progress: Callable[[int, str], Any], timeout: float
) -> dict[str, Any]:
    with progress(len(workload.requests), label) as bar:
        run = asyncio.run(run_offline(label, server.address, workload, bar, timeout, server.cpu_seconds))
    cpu = {name: seconds for name, seconds in run.extra["cpu_s"].items() if name != LOAD_GENERATOR}
    return cell(run.summary(), run.extra["scheduler_counters"], cpu)


def median_cell(key: tuple[int, str, str], cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell of the table: (batch, workload, method), the median of each figure over its
    runs (:func:`cell`), and the runs."""
    batch, workload, method = key
    figures = ("output_tok_s", "tokens_per_forward", "ms_per_step", "cpu_ms_per_step", "output_tok_cpu_s",
               "spec_acceptance_rate", "spec_mean_acceptance_length", "spec_proposals_per_step",
               "forwards")  # fmt: skip
    median = {name: statistics.median(c[name] for c in cells) for name in figures if cells[0][name] is not None}
    return {"batch": batch, "workload": workload, "method": method, **median, "runs": cells}


def with_ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cell with its ratios against ``off`` at the same batch size and workload:
    ``speedup`` (tok/s), ``forward_ratio`` (tokens per forward), ``step_ratio`` (CPU ms per
    step) and ``cpu_speedup`` (output tokens per CPU second)."""
    off = {(c["batch"], c["workload"]): c for c in cells if c["method"] == OFF}
    ratios = (("speedup", "output_tok_s"), ("forward_ratio", "tokens_per_forward"), ("step_ratio", "cpu_ms_per_step"),
              ("cpu_speedup", "output_tok_cpu_s"))  # fmt: skip
    for c in cells:
        ref = off.get((c["batch"], c["workload"]))
        for name, figure in ratios:
            if ref is not None and c.get(figure) is not None and ref.get(figure):
                c[name] = c[figure] / ref[figure]
    return cells


def table(cells: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table (docs/benchmarks.md takes it as printed)."""

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 3 + "---:|" * (len(COLUMNS) - 3)]
    for c in sorted(cells, key=lambda c: (c["batch"], c["workload"], list(METHODS).index(c["method"]))):
        speculating = "--speculative-method" in METHODS[c["method"]]
        row = [
            str(c["batch"]), c["workload"], c["method"], num(c["output_tok_s"], ".1f"), num(c.get("speedup"), ".2f"),
            num(c["forwards"], ".0f"), num(c["tokens_per_forward"], ".2f"), num(c.get("forward_ratio"), ".2f"),
            num(c.get("cpu_ms_per_step"), ".2f"), num(c.get("step_ratio"), ".2f"), num(c.get("cpu_speedup"), ".2f"),
            num(c["spec_acceptance_rate"], ".2f") if speculating else "-",
            num(c["spec_mean_acceptance_length"], ".2f") if speculating else "-",
            num(c["spec_proposals_per_step"], ".1f") if speculating else "-",
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
